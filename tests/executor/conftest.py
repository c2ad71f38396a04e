"""Executor test fixtures: runners built from the presets (seeded random weights)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from executor_svc.runner import ModelRunner, build_runner

from .oracle import make_settings


@pytest.fixture
def make_runner() -> Callable[..., ModelRunner]:
    def factory(preset: str = "tiny-llama", **overrides: object) -> ModelRunner:
        return build_runner(make_settings(preset, **overrides))

    return factory


@pytest.fixture
def tiny_runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return make_runner("tiny-llama")
