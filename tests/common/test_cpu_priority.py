"""The gateway's and allocator's CPU priority: every thread's nice value raised, capped at
Linux's lowest priority, inherited by later threads; 0 leaves it. In a child process: the
test's own threads keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A process with a second thread already running lowers its priority, then starts a third;
# it prints every thread's nice value (from /proc, per thread) before and after.
CHILD = """
import json, os, sys, threading
from common.cpu_priority import lower_cpu_priority

def nice_of(tid):
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[16])  # stat's 19th field; the split starts at the 3rd

running, stop = threading.Event(), threading.Event()
early = threading.Thread(target=lambda: (running.set(), stop.wait()))
early.start()
running.wait()
before = {tid: nice_of(tid) for tid in os.listdir("/proc/self/task")}
lower_cpu_priority(int(sys.argv[1]))
after = {tid: nice_of(tid) for tid in before}
late = []
started_later = threading.Thread(target=lambda: late.append(nice_of(threading.get_native_id())))
started_later.start()
started_later.join()
stop.set()
early.join()
print(json.dumps({"before": before, "after": after, "late": late[0]}))
"""


def run_child(niceness: int, start_nice: int = 0) -> dict[str, dict[str, int] | int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(niceness)], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
        preexec_fn=(lambda: os.nice(start_nice)) if start_nice else None)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_every_thread_is_lowered_and_later_threads_inherit_it():
    got = run_child(10)
    before, after = got["before"], got["after"]
    assert isinstance(before, dict) and isinstance(after, dict) and len(before) >= 2
    assert after == {tid: min(19, nice + 10) for tid, nice in before.items()}
    assert got["late"] == max(after.values())


def test_the_nice_value_stops_at_linuxs_lowest_priority():
    # Started at nice 10 (or more), 10 + 15 is past 19: no error, the lowest priority.
    got = run_child(15, start_nice=10)
    assert set(got["after"].values()) == {19}  # type: ignore[union-attr]


def test_zero_leaves_the_priority_as_it_was():
    got = run_child(0)
    assert got["after"] == got["before"]
