"""The control plane's CPU priority, lowered on request so that a CPU executor on its cores runs
first.

A CPU executor's OpenMP threads work in lockstep: when the gateway or the allocator takes one
of their cores mid-step, the other thread waits at the next barrier for all of it, so every
millisecond of control-plane CPU costs the executor about two. With a higher nice value the
scheduler runs the services beside the executor's threads rather than in front of them
(bench/README.md, "The control plane's CPU priority"). Where they do not share cores it
changes nothing. Off by default: the services then answer later while those threads spin,
which costs latency at low concurrency.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)
MAX_NICE = 19  # Linux's lowest priority
# The gateway's and the allocator's `--nice` setting.
NICE_DEFAULT = 0
NICE_HELP = ("added to the process's nice value at start-up, so that a CPU executor on the "
             "same cores runs first (0: unchanged; 10: a few percent more offline throughput "
             "on two shared cores, at some latency at concurrency 1)")
NICE_MUST = f"in 0..{MAX_NICE}"


def lower_cpu_priority(niceness: int) -> None:
    """Add `niceness` to every thread of this process (Linux keeps a nice value per thread,
    and a thread started later takes its creator's; past MAX_NICE it stops there)."""
    if niceness <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: this thread only
        threads = [0]
    for tid in threads:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, now + niceness)
        except OSError:  # (a thread that ended meanwhile)
            continue
    log.info("cpu_priority_lowered", nice=os.getpriority(os.PRIO_PROCESS, 0))
