"""The one thread that runs torch in an executor: loading the model, every step and release.

NOTE: OpenMP (libgomp, torch's CPU backend) gives every thread that starts parallel work a
thread team of its own. With two such threads in one process (the model loaded in one, the
steps run in another) it manages more threads than there are cores, and then it stops
spinning between parallel regions: each of a step's hundreds of small ops waits for its
team to wake up (figures: bench/README.md, "Executor CPU kernels"). So everything that
touches torch runs here, one call at a time, in submission order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def compute_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-compute")
