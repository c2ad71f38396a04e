"""Building and loading the C++ CPU kernels (executor_svc/cpu_kernels) across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc.cpu_kernels import BUILD_DIR, source_digest

from .oracle import built_kernels

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LOAD = ("import sys; from executor_svc.cpu_kernels import load; "
        "sys.exit(0 if load() is not None else 1)")


def test_a_builder_killed_mid_build_does_not_hang_the_next_load() -> None:
    # torch's builder waits for as long as its `lock` file exists; one killed mid-build (an
    # executor stopped by a start-up timeout while compiling) leaves the file behind, and every
    # executor after it hung at start. The next load must see it as stale and go on.
    built_kernels()  # built once; the load below is then milliseconds, not a compile
    stale = BUILD_DIR / source_digest() / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, timeout=120,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)
