"""`python -m tools.launch` brings the three services up, prints how to call them, serves
the CLI client, and stops everything on Ctrl-C (SIGINT)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e_stack import ROOT


def test_launch_starts_serves_and_stops_on_ctrl_c(tmp_path: Path):
    # The defaults (the embedded real model), ports 0, logs to files; the printed chat command
    # answers with real text; SIGINT ends all.
    launch = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--gateway-port", "0", "--allocator-port", "0",
         "--executor-port", "0", "--log-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert launch.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = launch.stdout.readline()
            lines.append(line)
            if "grpcurl" in line or not line:
                break
        text = "".join(lines)
        match = re.search(r"--addr (\S+) --chat", text)
        assert match, f"no chat client command printed:\n{text}"
        assert "grpcurl -plaintext" in text
        client = subprocess.run(
            [sys.executable, "-m", "tools.client", "--addr", match.group(1), "--chat",
             "What is the capital of France?", "--max-tokens", "32", "--temperature", "0"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        assert client.returncode == 0, client.stderr
        assert "Paris" in client.stdout
        assert "FINISH_REASON_STOP" in client.stderr
        launch.send_signal(signal.SIGINT)
        assert launch.wait(30) == 0
        for name in ("allocator", "executor-0", "gateway"):
            log = (tmp_path / f"{name}.log").read_text()
            assert "server_stopped" in log or "gateway_stopped" in log, name
    finally:
        if launch.poll() is None:
            launch.kill()
