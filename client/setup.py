"""The client on its own: `pip install ./client` (or `pip wheel ./client`, from a checkout)
installs `pagedkv_client` and the gateway's generated stubs (`pagedkv.gateway.v1`), with grpcio
and protobuf and nothing else. The root distribution (`pip install .`) carries the same client
beside every service's stubs, for the services' own use: install one or the other.

The sources are staged into build/staged: the client package from ../pagedkv_client, and the
stubs of ../protos/pagedkv/gateway/v1/gateway.proto, generated with grpcio-tools (a build
requirement) as the root setup.py generates all of them. The stubs refuse runtimes older than
the grpcio-tools that generated them, so the requirements' floors are read from the stubs.
"""

from __future__ import annotations

import re
import shutil
from importlib.resources import files
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUILD = HERE / "build"
STAGED = BUILD / "staged"
PROTO = Path("pagedkv") / "gateway" / "v1" / "gateway.proto"
# Namespace packages (no __init__.py), laid out as the root distribution's.
STUB_PACKAGES = ["pagedkv", "pagedkv.gateway", "pagedkv.gateway.v1"]


def stage() -> None:
    if not (ROOT / "pagedkv_client").is_dir() or not (ROOT / "protos" / PROTO).is_file():
        raise SystemExit("pagedkv-client builds from a checkout of pagedkv: "
                         "`pip install ./client` or `pip wheel ./client` at its root")
    from grpc_tools import protoc

    shutil.rmtree(BUILD, ignore_errors=True)  # no module of an older build in the wheel
    STAGED.mkdir(parents=True)
    shutil.copytree(ROOT / "pagedkv_client", STAGED / "pagedkv_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    args = ["grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"-I{files('grpc_tools') / '_proto'}",
            f"--python_out={STAGED}", f"--grpc_python_out={STAGED}", f"--pyi_out={STAGED}",
            str(ROOT / "protos" / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on protos/{PROTO} (its message is above)")
    (STAGED / PROTO.parent / "py.typed").touch()  # PEP 561, as the root distribution's


def requirements() -> list[str]:
    """grpcio at least the generating grpcio-tools' version, protobuf at least the stubs'
    gencode version and below its next major (the versions each stub checks at import)."""
    stubs = STAGED / PROTO.parent
    grpc = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                     (stubs / "gateway_pb2_grpc.py").read_text())
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                        (stubs / "gateway_pb2.py").read_text())
    if grpc is None or gencode is None:
        raise SystemExit("cannot read the generated stubs' versions (grpcio-tools changed?)")
    major, minor, patch = (int(x) for x in gencode.groups())
    return [f"grpcio>={grpc.group(1)}", f"protobuf>={major}.{minor}.{patch},<{major + 1}"]


stage()
setup(
    package_dir={"": "build/staged"},
    packages=[*STUB_PACKAGES, "pagedkv_client"],
    package_data={"": ["*.pyi", "py.typed"]},
    install_requires=requirements(),
)
