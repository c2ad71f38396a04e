"""`python -m tools.launch` brings the three services up, prints how to call them (gRPC,
HTTP, the model's name, the metrics ports), serves the CLI client, forwards the services'
own flags, refuses flags nobody takes, runs from any directory, and stops everything on
Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from e2e_stack import ROOT

from pagedkv_client import Client
from tools.flag_routing import route_flags, service_flags


def test_launch_starts_serves_and_stops_on_ctrl_c(tmp_path: Path):
    # The defaults (the embedded real model), ports 0, logs to files; the printed chat command
    # answers with real text; SIGINT ends all.
    launch = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--gateway-port", "0", "--allocator-port", "0",
         "--executor-port", "0", "--http-port", "0", "--log-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its services in its group: a failed test stops them all
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
             "What is the capital of France?", "--max-tokens", "32", "--temperature", "0",
             "--request-id", "cli-1"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        assert client.returncode == 0, client.stderr
        assert "Paris" in client.stdout
        assert "FINISH_REASON_STOP" in client.stderr and "(request cli-1)" in client.stderr
        launch.send_signal(signal.SIGINT)
        assert launch.wait(30) == 0
        for name in ("allocator", "executor-0", "gateway"):
            log = (tmp_path / f"{name}.log").read_text()
            assert "server_stopped" in log or "gateway_stopped" in log, name
    finally:
        stop_group(launch)


def stop_group(launch: subprocess.Popen[str]) -> None:
    """Kill whatever of the launcher's group is left: killing the launcher alone would
    leave its services holding their ports (a later run's default HTTP port among them)."""
    try:
        os.killpg(launch.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it stopped them all and exited
    launch.wait(30)


def read_until_up(launch: subprocess.Popen[str], timeout_s: float = 120) -> str:
    """The launcher's output up to its "Ctrl-C stops everything." (or its exit)."""
    assert launch.stdout is not None
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = launch.stdout.readline()
        lines.append(line)
        if "Ctrl-C stops everything" in line or not line:
            break
    return "".join(lines)


def test_launch_from_another_directory_forwards_service_flags_and_prints_addresses(
        tmp_path: Path):
    # Started outside the checkout (which is on PYTHONPATH), a preset by name, a log folder
    # to create, two executors and flags of the services' own: --block-size reaches the
    # executors, --max-num-seqs the executors and the gateway, --log-json all three, --nice
    # the gateway and the allocator (they log the value read back). The
    # printed gRPC and HTTP addresses, model name and metrics ports are the real ones.
    launch = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--model", "tiny-llama", "--num-executors", "2",
         "--gateway-port", "0", "--allocator-port", "0", "--executor-port", "0",
         "--http-port", "0", "--allocator-metrics-port", "0", "--executor-metrics-port", "0",
         "--log-dir", "logs/launch", "--block-size", "32", "--max-num-seqs=8", "--log-json",
         "--nice", "5"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        text = read_until_up(launch)
        match = re.search(r"gateway: gRPC (\S+), HTTP (http://\S+/v1) \(OpenAI-compatible\), "
                          r"model (\S+)\n", text)
        assert match, text
        grpc_addr, http_base, model = match.groups()
        with Client(grpc_addr, timeout=30) as client:
            info = client.model_info()
        assert info.model_name == model
        assert [e.block_size for e in info.executors] == [32, 32]
        with urllib.request.urlopen(f"{http_base}/models", timeout=30) as response:
            assert model in response.read().decode()
        metrics = re.search(r"metrics: allocator (\S+), executor-0 (\S+), executor-1 (\S+),",
                            text)
        assert metrics, text
        for url in metrics.groups():
            with urllib.request.urlopen(url, timeout=30) as response:
                assert response.status == 200
        logs = tmp_path / "logs" / "launch"
        for name in ("allocator", "executor-0", "executor-1", "gateway"):
            lines = [json.loads(line) for line in (logs / f"{name}.log").read_text().splitlines()]
            assert lines[0]["service"], name  # --log-json reached it
            lowered = [e["nice"] for e in lines if e["event"] == "cpu_priority_lowered"]
            assert lowered == ([] if name.startswith("executor") else [min(19, os.nice(0) + 5)])
        launch.send_signal(signal.SIGINT)
        assert launch.wait(30) == 0
    finally:
        stop_group(launch)


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag", "1"], "unrecognized flag '--no-such-flag'"),
    (["--port", "1"], "--port is set by the launcher"),
    (["--shard-index", "1"], "--shard-index is set by the launcher: use --allocator-shards"),
    (["--pool-name", "p"], "--pool-name is set by the launcher"),
    (["--allocator-shards", "0"], "--allocator-shards must be in 1..256"),
    (["--block-size", "many"], "executor: argument --block-size: invalid int value"),
    (["--role", "decode"], "--role is set by the launcher: use --prefill-executors"),
    (["--prefill-executors", "1"], "--prefill-executors must be >= 0 and leave at least one "
                                   "decode executor: got 1 of --num-executors 1"),
    (["--num-executors", "3", "--prefill-executors", "-1"], "--prefill-executors must be >= 0"),
])
def test_launch_flag_no_service_takes_is_a_usage_error(flags: list[str], message: str,
                                                       tmp_path: Path):
    # Refused before anything starts: exit 2, the flag named, no log folder made.
    done = subprocess.run(
        [sys.executable, "-m", "tools.launch", "--log-dir", str(tmp_path / "logs"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "logs").exists()


def test_launch_routes_each_flag_to_every_service_that_takes_it():
    # Read from the services' own parsers: a flag several take goes to each, with its value.
    routed = route_flags(["--block-size", "32", "--max-num-seqs=8", "--log-json",
                          "--enable-prefix-caching", "false"], service_flags())
    assert routed == {
        "allocator": ["--log-json"],
        "executor": ["--block-size", "32", "--max-num-seqs=8", "--log-json"],
        "gateway": ["--max-num-seqs=8", "--log-json", "--enable-prefix-caching", "false"],
    }

