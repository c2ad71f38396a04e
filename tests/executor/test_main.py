"""`python -m executor_svc`: bad settings exit with a message; the port file carries the port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .oracle import MODELS

pytestmark = pytest.mark.e2e

ROOT = MODELS.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "executor_svc", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_main_rejects_bad_settings_with_a_remedy() -> None:
    # A flag that cannot work exits 2 and says which flag and what to use instead.
    result = _run("--model", "/nonexistent", "--port", "0", "--insecure")
    assert result.returncode == 2
    assert "--model '/nonexistent' is not a directory" in result.stderr


def test_main_rejects_a_bad_role_in_one_line() -> None:
    # Either executor: exit 2, one line naming --role and its choices.
    for module in ("executor_svc", "executor_svc.simulated"):
        command = [sys.executable, "-m", module, "--role", "sideways", "--insecure"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            f"python -m {module}: error: --role must be one of prefill, decode, both, "
            "not 'sideways'"]


def test_main_refuses_to_start_without_internal_credentials() -> None:
    # Closed by default: no token, no TLS and no explicit --insecure is a usage error.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDKV_ROLE_TOKEN", "PAGEDKV_CALLER_DIGESTS", "PAGEDKV_INTERNAL_TOKEN")}
    result = subprocess.run([sys.executable, "-m", "executor_svc", "--port", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "no internal credentials" in result.stderr


def test_main_writes_port_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    # --port 0 binds a free port, written to --port-file; SIGTERM stops it with status 0.
    port_file = tmp_path / "port"
    command = [
        sys.executable, "-m", "executor_svc", "--load-format", "dummy", "--port", "0",
        "--port-file", str(port_file), "--kv-cache-memory", "4MiB", "--swap-space", "0",
        "--log-json", "--insecure",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        port = int(port_file.read_text())
        assert 0 < port < 65536
    finally:
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-2000:]
    assert f'"port": {port}' in stderr and '"event": "server_started"' in stderr
    assert '"event": "server_stopped"' in stderr
    assert '"event": "malloc_settings"' in stderr and '"tuned": true' in stderr
