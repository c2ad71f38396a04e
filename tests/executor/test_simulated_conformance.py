"""The executor conformance suite, run against two simulated executors started on port 0, as
a platform team runs it against theirs (`make conformance EXECUTOR_ADDR=...
EXECUTOR_ADDR_2=...`: the second for KV hand-off)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.credentials import RoleTokens

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path,
                                                                      Path]:
    port_file, log_path = tmp_path / f"{name}.port", tmp_path / f"{name}.log"
    command = [sys.executable, "-m", "executor_svc.simulated", "--model",
               str(ROOT / "models" / "tiny-llama"), "--time-scale", "0", "--num-blocks", "512",
               "--num-cpu-blocks", "64", "--max-num-seqs", "16", "--max-num-batched-tokens",
               "512", "--port", "0", "--port-file", str(port_file), "--metrics-port", "-1"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    return process, port_file, log_path


def test_simulated_executor_passes_the_conformance_suite(tmp_path: Path) -> None:
    # Everything passes but the two cases about logits processors' numerics, which the
    # suite skips for a simulated executor (Describe's backend), saying why.
    tokens = RoleTokens.new()
    # The executors get theirs; the suite plays the gateway, and an executor for ExportKV.
    env = {**os.environ, **tokens.env("executor")}
    suite_env = {**env, "PAGEDKV_ROLE_TOKEN": tokens.token("gateway"),
                 "PAGEDKV_EXECUTOR_TOKEN": tokens.token("executor")}
    started = [_start(tmp_path, name, env) for name in ("first", "second")]
    try:
        deadline = time.monotonic() + 30
        for process, port_file, log_path in started:
            while not port_file.exists():
                assert process.poll() is None and time.monotonic() < deadline, (
                    log_path.read_text())
                time.sleep(0.05)
        first, second = (f"127.0.0.1:{port_file.read_text().strip()}"
                         for _, port_file, _ in started)
        suite = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "tests/conformance",
             f"--executor-addr={first}", f"--executor-addr-2={second}"],
            cwd=ROOT, env=suite_env, capture_output=True, text=True, timeout=300,
        )
    finally:
        for process, _, log_path in started:
            process.terminate()
            assert process.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    summary = suite.stdout.strip().splitlines()[-1]
    assert suite.returncode == 0, suite.stdout[-5000:] + suite.stderr[-2000:]
    assert " 2 skipped" in summary and "failed" not in summary, summary
    assert suite.stdout.count("backend 'simulated'") == 1, suite.stdout[-3000:]
