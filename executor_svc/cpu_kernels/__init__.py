"""The executor's C++ CPU kernels (csrc/), compiled once by torch's extension builder.

- paged_decode.cpp: decode attention over the paged cache, read in place
  (attention/cpu_backend.py);
- fused_ops.cpp: RMSNorm, silu(gate) * up and rotary q/k in one pass each (fused_layers.py);
- sampling.cpp: each row's argmax and log-sum-exp in one pass for the sampler (sampler.py);
- packed_gemm.cpp: float32 linear layers through MKL's packed GEMM (packed_linear.py);
- small_gemm.cpp: linear layers of a few rows on the plain weights (packed_linear.py);
- layer_stack.cpp: a step of decode rows and fresh prompts through every decoder layer in
  one call, bfloat16 or float32 (layer_loop.py);
- prefill_attention.cpp: causal attention of prompts with no cached prefix, over their packed
  rows (attention/torch_backend.py);
- simd.h: float32 vectors and bfloat16 conversions that compile for any x86 level;
- bindings.cpp: the Python module that exposes them.

`make setup` builds them (`python -m executor_svc.cpu_kernels`) into
build/cpu_kernels/<digest>/, named by a digest of their sources, their flags and, built for
this machine (-march=native unless PAGEDKV_KERNEL_MARCH names a portable level), this CPU's
model and instruction-set flags: two checkouts that share a build directory never rebuild or
load each other's library, and a checkout moved to another kind of CPU builds its own instead
of loading instructions that could be illegal there. An executor then loads the built library
in milliseconds.
Where no compiler is at hand the kernels are unavailable and the executor falls back to the
torch reference path, with a WARNING that says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import structlog

from common.cpu_info import cpu_flags, cpu_model, cpuinfo
from common.model_dirs import REPO_ROOT

log = structlog.get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "paged_decode.cpp", CSRC / "fused_ops.cpp", CSRC / "sampling.cpp",
           CSRC / "packed_gemm.cpp", CSRC / "small_gemm.cpp", CSRC / "layer_stack.cpp",
           CSRC / "prefill_attention.cpp", CSRC / "bindings.cpp"]
BUILD_DIR = REPO_ROOT / "build" / "cpu_kernels"
# NOTE: fast-math lets gcc vectorise expf (glibc's libmvec) and reorder the dot products'
# sums; the kernel produces no infinities or NaNs for it to mishandle (scores are finite and
# the softmax subtracts the row's max first).
# PAGEDKV_KERNEL_MARCH picks another target, e.g. x86-64-v3 for an image that runs elsewhere.
MARCH = os.environ.get("PAGEDKV_KERNEL_MARCH", "native")
CFLAGS = ("-O3", f"-march={MARCH}", "-ffast-math", "-fopenmp")
LDFLAGS = ("-lm", "-fopenmp")


def source_digest(cpu: str | None = None) -> str:
    """12 hex digits of the sources, the header, the flags and (built for this machine) the
    CPU they are built for: the build's directory name."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    if MARCH == "native":
        digest.update(b"\0" + (native_cpu() if cpu is None else cpu).encode())
    return digest.hexdigest()[:12]


def native_cpu() -> str:
    """What -march=native resolves from: this CPU's model and feature flags (elsewhere than
    Linux, the platform's machine name)."""
    if not cpuinfo():
        return platform.machine()
    return f"{cpu_model()}\0{' '.join(sorted(cpu_flags()))}"


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled module, or None (logged) where it cannot be built or loaded."""
    # The ninja that pip installed sits beside this interpreter, maybe not on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load as build

        build_dir = BUILD_DIR / source_digest()
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's builder marks a build with a plain file (`lock`) and waits, forever, while
        # it exists; a builder killed mid-build (a test's start-up timeout) leaves it behind.
        # One builder at a time holds this flock (the kernel drops it when the holder dies),
        # so whoever holds it knows any `lock` there is stale.
        with open(build_dir / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return build(
                name="pagedkv_cpu_kernels",
                sources=[str(s) for s in SOURCES],
                build_directory=str(build_dir),
                extra_cflags=list(CFLAGS),  # copies: torch's builder appends to them
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning(
            "cpu_kernels_unavailable",
            reason=str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc),
            remedy="install a C++ compiler and ninja, then run `make setup`; the torch "
            "reference path serves meanwhile",
        )
        return None

