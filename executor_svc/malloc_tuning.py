"""glibc malloc, set up so that a step's large tensors reuse memory instead of mapping it anew.

Every step allocates and frees tensors of tens of MiB. The logits alone are rows x vocab x 4
bytes, 31 MiB at 256 rows of a 32,000-token vocabulary. glibc's defaults hurt here in two ways:
- Chunks over its mmap threshold (at most 32 MiB) are mapped on allocation and unmapped on free.
- The step's worker thread allocates from its own arena. Those heaps are mapped and unmapped as
  they fill and empty.

Either way, a step page-faults its buffers in and unmaps them afterwards. Unmapping a touched
64 MiB heap took 2.1-3.1 ms here (strace). At 256 running, some executor runs paid it on every
step: sampling took 22 ms instead of 8, and freeing the logits added 4.3 ms to the control plane.
At 512 rows, the lm_head plus log-softmax took 145 ms plus 9 ms to free, against 98 ms plus
0.02 ms tuned. `python -m bench.control_plane --compare N --baseline untuned-malloc` compares
the two.

So, before torch and grpc start their threads (executor_svc/__main__.py), on CPU executors:
- one arena (M_ARENA_MAX=1). All threads then share one allocator lock. At 64 running the
  tuned executor was slightly slower (2.38 against 2.22 ms of control plane, medians of four
  runs each): the lock, or noise;
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
