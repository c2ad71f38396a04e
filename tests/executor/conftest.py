"""Executor test fixtures: runners built from the presets (seeded random weights)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from executor_svc.packed_linear import MATMUL_LIBRARIES, MATMUL_LIBRARY_ENV
from executor_svc.runner import ModelRunner, build_runner

from .oracle import built_kernels, make_settings


@pytest.fixture
def make_runner() -> Callable[..., ModelRunner]:
    def factory(preset: str = "tiny-llama", **overrides: object) -> ModelRunner:
        return build_runner(make_settings(preset, **overrides))

    return factory


@pytest.fixture
def tiny_runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return make_runner("tiny-llama")


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """The C++ CPU kernels (fails where they did not build)."""
    return built_kernels()


@pytest.fixture(params=MATMUL_LIBRARIES)
def matmul_library(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with MKL and with oneDNN computing the linears, whichever the CPU picks:
    an Intel machine still tests the oneDNN path other CPUs take, and the reverse."""
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, request.param)
    return str(request.param)
