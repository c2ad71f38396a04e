"""Offline replay of an allocation recording (`allocator_svc --record-allocations`) for
capacity planning: `python -m tools.replay RECORDING [--num-blocks N,...] [--block-size B,...]
[--preemption-mode recompute|swap] [--preemption-policy tail|cost] [--find-min-blocks]
[--json OUT]`.

A trace-driven simulation, not a re-send of the recorded calls (a smaller pool preempts
differently from the recorded one, so the calls it would get differ too): the recording is
read into the workload it carried (each request's arrival, prompt as a chain of prefix
hashes, length, forks; `trace.py`), turned into token ids at any block size (`tokens.py`),
and served by the gateway's own scheduler in front of the real allocator core, in process,
one step after another (`simulator.py`, through `core_link.py`); `search.py` finds the
smallest pool that serves it without preemption; `report.py` prints and writes the figures.
"""
