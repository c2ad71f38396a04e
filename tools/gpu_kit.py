"""`python -m tools.gpu_kit`: the wheels and files the one prepared device run carries.

The lent GPU machine has Python 3.12 with torch, triton and transformers but no network, so
what the services and the GPU test suites import beyond its packages
(/work/.library/device/KINDS.md) travels as cp312 wheels in `.gpu_kit/wheels/`, at the
versions of this virtualenv. `make gpu-kit` runs this after the stubs and the FlashInfer
bundle, and fails when what the device call sends would not fit its 64 MiB.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu_kit"
WHEELS = KIT / "wheels"
# Everything a device call sends (tools/gpu_check.py's carry list) beside the tracked tree.
CARRIED = (".gpu_kit", ".fi_bundle", "pagedkv")
# Made by make gpu-kit (this, the bundle script, make protos) before the size check means anything.
REQUIRED = (".gpu_kit/flashinfer_gpu_check.py", ".fi_bundle/flashinfer_trimmed.zip",
            "pagedkv/.generated")
LIMIT_MIB = 60.0  # the device takes 64 MiB; the rest is headroom for untracked edits

# What the services, bench.gpu and tests/{executor,conformance,e2e} import that the device
# lacks (checked by importing them and collecting the suites here), with their needs.
KIT_PACKAGES = (
    # The stubs in pagedkv/ check the grpcio and protobuf versions they were generated with.
    "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection",
    "structlog",
    "fastapi", "opentelemetry-api", "starlette", "sse-starlette", "uvicorn",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    # Needed at versions that may be newer than the device's: pydantic wants typing-extensions
    # >= 4.16, openai anyio >= 4.10, httpx2 idna >= 3.18, httpcore2 h11 >= 0.16. The
    # environment stage lists any requirement of the kit that the device still leaves unmet.
    "typing-extensions", "anyio", "idna", "h11",
    "cryptography", "cffi", "pycparser",  # tests/e2e/test_tls.py imports tools.make_certs
    "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio",  # tests/e2e's client
)
# glibc 2.39 there (Ubuntu 24.04's Python 3.12.3); pip matches each manylinux tag exactly.
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(names: tuple[str, ...] = KIT_PACKAGES) -> dict[str, str]:
    """name -> the version installed in this virtualenv (one each: two stop the install)."""
    return {canonical(name): metadata.version(name) for name in names}


def wheel_key(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return canonical(name), version


def download_wheels(pins: dict[str, str], folder: Path = WHEELS) -> None:
    """Wheels for the device's interpreter, each at its pin; stale versions removed first."""
    folder.mkdir(parents=True, exist_ok=True)
    present = set()
    for wheel in folder.glob("*.whl"):
        if pins.get(wheel_key(wheel.name)[0]) == wheel_key(wheel.name)[1]:
            present.add(wheel_key(wheel.name)[0])
        else:
            wheel.unlink()
    missing = [f"{name}=={version}" for name, version in pins.items() if name not in present]
    if missing:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                        "cp", *platforms, "-d", str(folder), *missing], check=True)
    got = sorted(wheel_key(wheel.name) for wheel in folder.glob("*.whl"))
    assert got == sorted(pins.items()), f"wheels {got} are not the pins {sorted(pins.items())}"


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def travelling_bytes(root: Path = ROOT) -> dict[str, int]:
    """Bytes a device call sends: the tracked and untracked-not-ignored files, and CARRIED."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout.decode()
    files = (root / name for name in listed.split("\0") if name)
    sizes = {"working tree": sum(f.stat().st_size for f in files if f.is_file())}
    sizes.update({name: tree_bytes(root / name) if (root / name).exists() else 0
                  for name in CARRIED})
    return sizes


def check_sizes(sizes: dict[str, int], limit_mib: float = LIMIT_MIB) -> bool:
    total = sum(sizes.values())
    for name, size in [*sizes.items(), ("total", total)]:
        print(f"{name:<14} {size / 2**20:7.1f} MiB")
    if total > limit_mib * 2**20:
        print(f"over {limit_mib:.0f} MiB: the device call (64 MiB at most) would refuse it",
              file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_kit", description=__doc__)
    parser.add_argument("--shared-tools", type=Path, default=ROOT.parent / "shared" / "tools",
                        help="where flashinfer_gpu_check.py is (the device gets no ../shared)")
    parser.add_argument("--sizes-only", action="store_true", help="only the size check")
    args = parser.parse_args(argv)
    if not args.sizes_only:
        download_wheels(pinned_versions())
        target = KIT / "flashinfer_gpu_check.py"
        shutil.copyfile(args.shared_tools / "flashinfer_gpu_check.py", target)
    missing = [name for name in REQUIRED if not (ROOT / name).is_file()]
    if missing:
        print(f"missing {missing}: run make gpu-kit", file=sys.stderr)
        return 1
    return 0 if check_sizes(travelling_bytes()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
