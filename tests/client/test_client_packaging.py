"""The project builds a wheel holding the generated stubs and the client, from the sources
alone (a copy without pagedkv/, as on a clean clone), with no network."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("setup.py", "pyproject.toml", "MANIFEST.in", "protos", "pagedkv_client")
PIP_OFFLINE = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_INDEX": "1"}


@pytest.mark.packaging
def test_client_wheel_has_the_stubs_and_the_client_and_imports(tmp_path: Path):
    # Built in a copy, so the checkout's own pagedkv/ is neither used nor rewritten; with
    # this environment's build tools (--no-build-isolation: pyproject's [build-system]).
    import setuptools

    # pyproject's [build-system] (bdist_wheel built in since 70.1): set-up installs it.
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    assert (major, minor) >= (70, 1), f"setuptools {setuptools.__version__} < 70.1"
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name)
    env = {**os.environ, **PIP_OFFLINE}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(src),
         "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("pagedkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("gateway/v1/gateway_pb2.py", "gateway/v1/gateway_pb2_grpc.py",
                 "gateway/v1/gateway_pb2.pyi", "allocator/v1/allocator_pb2.py",
                 "executor/v1/executor_pb2.py"):
        assert f"pagedkv/{stub}" in names
    for module in ("__init__.py", "client.py", "aio.py", "py.typed"):
        assert f"pagedkv_client/{module}" in names
    assert not any(n.startswith(("gateway/", "tools/", "common/", "tests/")) for n in names)
    # Installed on its own, it imports from where it was installed.
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    check = subprocess.run(
        [sys.executable, "-c", "import pagedkv_client, pagedkv.gateway.v1.gateway_pb2 as g; "
         "print(pagedkv_client.__file__); print(g.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)})
    assert check.returncode == 0, check.stderr
    assert all(line.startswith(str(site)) for line in check.stdout.split())


CLIENT_WHEELS = ROOT / ".client-wheels"  # grpcio and protobuf, fetched by make setup


@pytest.mark.packaging
def test_the_client_distribution_installs_alone_and_answers(tmp_path: Path, tiny_stack):
    # ./client builds a wheel of the client and the gateway's stubs alone; a fresh
    # virtualenv takes it with grpcio and protobuf and nothing else (no torch, no
    # transformers, no server code), and its Client gets the reference's tokens from a real
    # gateway.
    from tests.e2e.e2e_stack import reference_greedy

    wheels = sorted(CLIENT_WHEELS.glob("*.whl"))
    assert wheels, f"{CLIENT_WHEELS} has no wheels: run `make setup`"
    env = {**os.environ, **PIP_OFFLINE}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         str(ROOT / "client"), "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("pagedkv_client-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"pagedkv/gateway/v1/gateway_pb2.py", "pagedkv/gateway/v1/gateway_pb2_grpc.py",
            "pagedkv_client/client.py", "pagedkv_client/py.typed"} <= names
    assert not any(n.startswith(("pagedkv/executor", "pagedkv/allocator", "gateway/"))
                   for n in names)
    # Its requirements are the runtimes its own stubs accept at import, no looser.
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    requires = sorted(line.split(": ", 1)[1] for line in metadata.decode().splitlines()
                      if line.startswith("Requires-Dist: "))
    grpc_stub = archive.read("pagedkv/gateway/v1/gateway_pb2_grpc.py").decode()
    grpc_floor = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub)
    gencode = re.search(r"Protobuf Python Version: (\d+)\.([\d.]+)",
                        archive.read("pagedkv/gateway/v1/gateway_pb2.py").decode())
    assert grpc_floor and gencode
    major = int(gencode.group(1))
    assert requires == [f"grpcio>={grpc_floor.group(1)}",
                        f"protobuf<{major + 1},>={major}.{gencode.group(2)}"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--find-links",
         str(CLIENT_WHEELS), str(wheel)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    prompt = [1, 17, 42, 99, 7]
    script = (
        "import importlib.metadata as m, importlib.util as u, json, sys\n"
        "from pagedkv_client import Client\n"
        "installed = sorted(d.metadata['Name'].lower() for d in m.distributions())\n"
        "missing = [n for n in ('torch', 'transformers', 'gateway') if u.find_spec(n)]\n"
        f"with Client({tiny_stack.stack.gateway_addr!r}) as client:\n"
        f"    result = client.complete({prompt}, max_tokens=6, temperature=0)\n"
        "print(json.dumps([installed, missing, list(result.token_ids)]))\n")
    run = subprocess.run([str(python), "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert run.returncode == 0, run.stderr
    installed, found, tokens = json.loads(run.stdout)
    # The client, grpcio, protobuf and what they require (the wheelhouse's), nothing more.
    wanted = {w.name.split("-")[0].replace("_", "-").lower() for w in wheels}
    assert {n.replace("_", "-") for n in installed} == {"pagedkv-client", *wanted}
    assert {"grpcio", "protobuf"} <= wanted and "torch" not in wanted
    assert found == []
    assert tuple(tokens) == reference_greedy(tuple(prompt), 6)
