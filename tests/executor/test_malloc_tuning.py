"""malloc_tuning: in a process that applies it, a worker thread's large tensor comes from the one
heap and stays there once freed; in one that does not (the control), glibc maps it and unmaps
it. Each case runs in a fresh interpreter, in the executor's order: its entry module imported
(without torch or grpc), then the tuning, then torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .oracle import MODELS

pytestmark = pytest.mark.e2e

# Runs in the child: tune (or not), then allocate 40 MiB (over glibc's largest mmap threshold)
# in a worker thread, as the executor's step does, and report what malloc did with it.
PROBE = """
import ctypes, json, sys, threading
import executor_svc.__main__
from executor_svc.malloc_tuning import tune_malloc

early = sorted({"torch", "grpc", "transformers"} & set(sys.modules))
assert not early, f"executor_svc.__main__ imports {early} before it tunes malloc"

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):  # glibc < 2.33, or not glibc
    print(json.dumps({"probe": False}))
    sys.exit(0)
libc.mallinfo2.restype = MallInfo2
tuned = tune_malloc() if sys.argv[1] == "tune" else False
import torch

seen = {"tuned": tuned}
def step():
    before = libc.mallinfo2()
    tensor = torch.ones(10 * 2**20)
    during = libc.mallinfo2()
    seen["mapped"] = during.hblkhd - before.hblkhd
    del tensor
    seen["kept"] = libc.mallinfo2().arena - before.arena

worker = threading.Thread(target=step)
worker.start()
worker.join()
print(json.dumps(seen))
sys.stdout.flush()
libc.malloc_stats()  # one "Arena N:" section per arena, on stderr
"""

TENSOR_BYTES = 40 * 2**20


def _probe(mode: str) -> tuple[dict[str, int], int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=MODELS.parent,
                            capture_output=True, text=True, timeout=120, check=True)
    arenas = sum(line.startswith("Arena ") for line in result.stderr.splitlines())
    seen = json.loads(result.stdout)
    if not seen.get("probe", True):
        pytest.skip("needs glibc >= 2.33 (mallinfo2), which this platform lacks; where it "
                    "exists (Linux, the Docker image, CI): "
                    ".venv/bin/pytest tests/executor/test_malloc_tuning.py")
    return seen, arenas


def test_tuned_malloc_keeps_a_worker_threads_large_tensor_in_the_one_heap() -> None:
    seen, arenas = _probe("tune")
    assert seen["tuned"]  # glibc (mallinfo2 is there): every mallopt must take
    assert seen["mapped"] == 0  # not mmap'ed...
    assert seen["kept"] >= TENSOR_BYTES  # ...but carved from the heap, and kept once freed
    assert arenas == 1  # the worker thread allocated from the main arena


def test_untuned_malloc_maps_the_same_tensor_and_gives_the_thread_its_own_arena() -> None:
    # The control: the probe can tell the two apart.
    seen, arenas = _probe("none")
    assert seen["mapped"] >= TENSOR_BYTES
    assert seen["kept"] < TENSOR_BYTES
    assert arenas > 1
