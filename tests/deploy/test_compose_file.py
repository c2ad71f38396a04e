"""docker-compose.yml and the Dockerfile, read without an engine: what `make compose-e2e`
checks for real, held here too, so a machine without Docker still catches a regression
(published ports, health checks that lag, a CUDA torch, files the services cannot read)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
LOOPBACK = "${PAGEDKV_BIND_ADDRESS:-127.0.0.1}:"


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, f"unexpected duration {duration!r}"
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60}[match[2]]


def _services_with_health() -> dict[str, dict]:
    return {name: service for name, service in COMPOSE["services"].items()
            if "healthcheck" in service}


def test_compose_publishes_only_the_gateways_ports_on_loopback_by_default() -> None:
    # Only the gateway publishes, gRPC and HTTP, each on 127.0.0.1 unless the variable opens it.
    published = {name: service["ports"] for name, service in COMPOSE["services"].items()
                 if service.get("ports")}
    assert list(published) == ["gateway"]
    assert [p.rsplit(":", 1)[1] for p in published["gateway"]] == ["50051", "8000"]
    assert all(p.startswith(LOOPBACK) for p in published["gateway"]), published


def test_compose_health_turns_unhealthy_quickly_after_start_up() -> None:
    # After start_period, a dead dependency shows within ~20 s, not the two minutes of 24 x 5 s.
    checked = _services_with_health()
    assert set(checked) >= {"allocator", "executor", "gateway"}
    for name, service in checked.items():
        health = service["healthcheck"]
        lag = health["retries"] * (_seconds(health["interval"]) + _seconds(health["timeout"]))
        assert lag <= 30, f"{name}: unhealthy only after {lag:.0f} s"
        assert _seconds(health["start_period"]) >= 60, f"{name}: start-up needs more time"


def test_dockerfile_installs_a_cpu_torch_apart_from_the_project() -> None:
    # torch's own index options (PyTorch's CPU index by default), never reused for the project.
    torch_install = next(line for line in DOCKERFILE.splitlines()
                         if line.startswith("RUN pip install") and "TORCH_SPEC" in line)
    assert "${TORCH_PIP_ARGS}" in torch_install and "PIP_EXTRA_ARGS" not in torch_install
    assert 'ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"' in DOCKERFILE
    assert "TORCH_PIP_ARGS" not in DOCKERFILE.split(torch_install, 1)[1]


def test_dockerfile_checks_as_the_services_user_that_every_file_is_readable() -> None:
    # The last step runs as pagedkv (uid 10001, as in deploy/k8s) and fails on unreadable files.
    steps = [line for line in DOCKERFILE.splitlines() if re.match(r"[A-Z]+ ", line)]
    after_user = steps[steps.index("USER pagedkv") + 1:]
    assert "useradd --system --uid 10001 pagedkv" in DOCKERFILE
    assert [s.split()[0] for s in after_user] == ["RUN", "EXPOSE", "CMD"]
    assert "find /app /opt/venv" in after_user[0] and "! -readable" in after_user[0]


def test_compose_gateway_health_needs_one_of_its_executors() -> None:
    # An idle gateway says SERVING until a step fails: its check asks the executors it routes to.
    gateway = COMPOSE["services"]["gateway"]
    executors = next(a for a in gateway["command"] if a.startswith("--executor-addrs="))
    test = gateway["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "tools.health_probe"]
    assert f"--any-of={executors.split('=', 1)[1]}" in test


def _kernel_stage_copies() -> list[tuple[list[str], str]]:
    """The (sources, destination) of each COPY the kernels' build step sees, after the model."""
    steps = [line for line in DOCKERFILE.splitlines() if re.match(r"[A-Z]+ ", line)]
    build = next(i for i, s in enumerate(steps) if s == "RUN python -m executor_svc.cpu_kernels")
    start = next(i for i, s in enumerate(steps) if s.startswith("COPY models "))
    copies = [s.split()[1:] for s in steps[start + 1:build] if s.startswith("COPY ")]
    return [(words[:-1], words[-1]) for words in copies]


def test_dockerfile_kernel_stage_copies_every_module_the_kernels_import(tmp_path: Path) -> None:
    # The image compiles the kernels from a subset of the sources (cached across edits): that
    # subset, laid out as COPY lays it out, must import the package and hold every source.
    copies = _kernel_stage_copies()
    assert copies, "no COPY before the kernels' build step"
    for sources, destination in copies:
        target = tmp_path / destination
        for source in sources:
            path = ROOT / source
            if path.is_dir():
                shutil.copytree(path, target if len(sources) == 1 else target / path.name,
                                dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target / path.name)
    probe = ("import executor_svc.cpu_kernels as k; "
             "missing = [str(p) for p in k.SOURCES if not p.is_file()]; "
             "assert not missing, missing; print(k.source_digest())")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"[0-9a-f]{12}\n", result.stdout), result.stdout
