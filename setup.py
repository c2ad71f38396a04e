"""Packaging: the generated gRPC stubs (`pagedkv`) and the client library (`pagedkv_client`).

The stubs are generated from protos/ whenever the project is built (`pip install .`,
`pip install -e .`, `pip wheel .`), into pagedkv/ beside this file: the same files as
`make protos`, never committed. Files whose content did not change are left alone, and the
others are replaced atomically, so a build does not pull them from under a running process.

The services (gateway, allocator_svc, executor_svc, common, tools) are not installed: they
run from the checkout (`python -m gateway`, `make run`, the Dockerfile), next to models/ and
the executor's C++ sources. The metadata and dependencies are in pyproject.toml; the package
list is here because the Dockerfile installs the dependencies from pyproject.toml alone.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "py.typed")


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def stub_packages() -> list[str]:
    """pagedkv/gateway/v1/gateway.proto -> pagedkv, pagedkv.gateway, pagedkv.gateway.v1."""
    names: set[str] = set()
    for proto in proto_files():
        parts = proto.parent.relative_to(PROTOS).parts
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names)


@functools.cache  # once per build process (egg_info and build_py both ask)
def generate_stubs() -> None:
    """protoc (grpcio-tools, a build requirement) into a scratch folder, then into pagedkv/."""
    from importlib.resources import files

    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = ["grpc_tools.protoc", f"-I{PROTOS}", f"-I{files('grpc_tools') / '_proto'}",
                f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
                *map(str, proto_files())]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on protos/ (its message is above)")
        for stub in Path(out).rglob("*_pb2.py"):  # PEP 561: type checkers read the .pyi
            (stub.parent / "py.typed").touch()
        fresh = {p.relative_to(out) for p in Path(out).rglob("*") if p.is_file()}
        for rel in fresh:
            _replace(Path(out) / rel, ROOT / rel)
    for stale in (ROOT / "pagedkv").rglob("*"):  # stubs of a proto that is gone
        if stale.name.endswith(GENERATED) and stale.relative_to(ROOT) not in fresh:
            stale.unlink()


def _replace(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    if dst.is_file() and dst.read_bytes() == data:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


class BuildPyWithStubs(build_py):
    """build_py that generates the stubs first (editable installs run it too)."""

    def run(self) -> None:
        generate_stubs()
        super().run()


class EggInfoWithStubs(egg_info):
    """egg_info (metadata, sdist) lists the package folders: they must exist by then."""

    def run(self) -> None:
        generate_stubs()
        super().run()


setup(
    packages=[*stub_packages(), "pagedkv_client"],
    package_data={"": ["*.pyi", "py.typed"]},
    cmdclass={"build_py": BuildPyWithStubs, "egg_info": EggInfoWithStubs},
)
