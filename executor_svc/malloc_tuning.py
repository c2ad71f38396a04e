"""glibc malloc, set up so that a step's large tensors reuse memory instead of mapping it anew.

Every step allocates and frees tensors of tens of MiB (the logits alone are rows x vocab x 4
bytes), and glibc's defaults map such chunks (over its mmap threshold, and the worker
thread's own arena) on allocation and unmap them on free: a step page-faults its buffers in
and unmaps them afterwards (figures: bench/README.md, "Executor CPU kernels").

So, before torch and grpc start their threads (executor_svc/__main__.py), on CPU executors:
- one arena (M_ARENA_MAX=1): all threads then share one allocator lock;
- no mmap'ed chunks (M_MMAP_MAX=0). glibc still maps memory when the heap cannot grow, and
  never returns that memory either;
- up to TRIM_THRESHOLD of freed memory kept at the top of the heap (M_TRIM_THRESHOLD).

The cost: the process keeps its peak step memory. Freed memory returns to the system only
from the top of the heap, and only beyond TRIM_THRESHOLD: a live allocation above freed
memory keeps it in the process.
"""

from __future__ import annotations

import ctypes

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

TRIM_THRESHOLD = 512 * 2**20

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def tune_malloc() -> bool:
    """Apply SETTINGS; False where the C library is not glibc (nothing is changed there)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # e.g. musl, whose mallopt does nothing, or macOS
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = [mallopt(param, value) == 1 for param, value in SETTINGS]  # each one tried
    return all(applied)
