"""The client on its own: `pip install ./client` (from a checkout) installs `pagedkv_client` and
the gateway's generated stubs (`pagedkv.gateway.v1`), with grpcio and protobuf and nothing
else. The root distribution (`pip install .`) carries the same client beside every service's
stubs for the services' own use.

The sources are staged into build/staged: the client package from ../pagedkv_client, and the
stubs of ../protos/pagedkv/gateway/v1/gateway.proto, generated with grpcio-tools (a build
requirement) as the root setup.py generates all of them.
"""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STAGED = HERE / "build" / "staged"
PROTO = Path("pagedkv") / "gateway" / "v1" / "gateway.proto"
# Namespace packages (no __init__.py), laid out as the root distribution's.
STUB_PACKAGES = ["pagedkv", "pagedkv.gateway", "pagedkv.gateway.v1"]


def stage() -> None:
    from grpc_tools import protoc

    shutil.rmtree(STAGED, ignore_errors=True)
    STAGED.mkdir(parents=True)
    shutil.copytree(ROOT / "pagedkv_client", STAGED / "pagedkv_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    args = ["grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"-I{files('grpc_tools') / '_proto'}",
            f"--python_out={STAGED}", f"--grpc_python_out={STAGED}", f"--pyi_out={STAGED}",
            str(ROOT / "protos" / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on protos/{PROTO} (its message is above)")
    (STAGED / PROTO.parent / "py.typed").touch()  # PEP 561, as the root distribution's


stage()
setup(
    package_dir={"": "build/staged"},
    packages=[*STUB_PACKAGES, "pagedkv_client"],
    package_data={"": ["*.pyi", "py.typed"]},
)
