"""tools/compose_e2e.py without an engine: the published-ports check on `docker inspect`
records shaped like docker 20.10's, and the build arguments for a local torch wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import compose_e2e

WANTED = {"50051/tcp": "41001", "8000/tcp": "41002"}


def _container(service: str, ports: dict[str, list[tuple[str, str]] | None]) -> dict:
    return {
        "Name": f"/pagedkv-e2e_{service}_1",
        "Config": {"Labels": {"com.docker.compose.service": service}},
        "NetworkSettings": {"Ports": {
            port: None if bindings is None else [{"HostIp": ip, "HostPort": host}
                                                 for ip, host in bindings]
            for port, bindings in ports.items()}},
    }


def test_port_problems_none_for_the_gateway_on_loopback_and_internal_ports_exposed() -> None:
    # The compose file as meant: gateway on 127.0.0.1, the rest only exposed (None bindings).
    containers = [
        _container("gateway", {"50051/tcp": [("127.0.0.1", "41001")],
                               "8000/tcp": [("127.0.0.1", "41002")]}),
        _container("executor", {"50053/tcp": None, "9093/tcp": None}),
        _container("allocator", {"50052/tcp": None, "9092/tcp": None}),
    ]
    assert compose_e2e.port_problems(containers, WANTED) == []


def test_port_problems_report_every_interface_and_published_internal_ports() -> None:
    # The old compose file bound 0.0.0.0 (and IPv6's ::); an executor publishing 9093 is caught.
    containers = [
        _container("gateway", {"50051/tcp": [("0.0.0.0", "41001"), ("::", "41001")],
                               "8000/tcp": [("127.0.0.1", "41002")]}),
        _container("executor", {"50053/tcp": None, "9093/tcp": [("127.0.0.1", "9093")]}),
    ]
    assert compose_e2e.port_problems(containers, WANTED) == [
        "gateway 50051/tcp is published on [('0.0.0.0', '41001'), ('::', '41001')], "
        "not on 127.0.0.1:41001 alone",
        "executor publishes 9093/tcp",
    ]


def test_build_args_install_torch_from_the_wheel_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local CPU wheel: copied into the build context, its exact version pinned, no index.
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"wheel")
    context = tmp_path / "docker-wheels"
    context.mkdir()
    monkeypatch.setattr(compose_e2e, "WHEELS_DIR", context)
    assert compose_e2e.build_args("pagedkv-ci-base:bookworm", wheel) == [
        "--build-arg", "BASE_IMAGE=pagedkv-ci-base:bookworm",
        "--build-arg", "TORCH_PIP_ARGS=", "--build-arg", "TORCH_SPEC=torch==2.13.0+cpu",
    ]
    assert (context / wheel.name).read_bytes() == b"wheel"
    assert compose_e2e.build_args("", None) == []
