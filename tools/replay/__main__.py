"""`python -m tools.replay RECORDING ...`: replay an allocation recording at other pool sizes,
block sizes and preemption modes; print a markdown table (and `--json OUT`).

Exit status: 0; 1 when the recording cannot be read (the message names the line); 2 for a
usage error, or a configuration that cannot serve the recording (a pool too small to hold
its largest request alone). Nothing is written unless every replay ran.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tools.replay.records import PoolTrace, RecordingError
from tools.replay.report import (
    HEADERS,
    MIN_HEADERS,
    markdown,
    min_row,
    payload,
    recorded_row,
    result_row,
    write_json,
)
from tools.replay.search import MinBlocks, find_min_blocks
from tools.replay.simulator import ReplayConfig, ReplayResult, replay
from tools.replay.step_time import StepTime
from tools.replay.trace import read_recording
from tools.replay.workload import ReplayError, Workload


def _list(parse: Callable[[str], object]) -> Callable[[str], list[object]]:
    def parse_all(text: str) -> list[object]:
        return [parse(part.strip()) for part in text.split(",") if part.strip()] or _none()

    return parse_all


def _none() -> list[object]:
    raise argparse.ArgumentTypeError("give at least one value")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _size(text: str) -> int | float:
    """N blocks, or N% of the recorded pool's tokens."""
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
        if percent <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not a positive percentage")
        return percent / 100
    return _positive(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", help="a file written by the allocator's --record-allocations")
    p.add_argument("--pool", action="append", default=None,
                   help="replay only this recorded pool (repeatable; default: every pool)")
    p.add_argument("--num-blocks", type=_list(_size), default=[1.0],
                   help="pool sizes: blocks, or N%% of the recorded pool's tokens at each "
                   "block size (default 100%%)")
    p.add_argument("--block-size", type=_list(_positive), default=None,
                   help="block sizes (default: the recorded one)")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None,
                   help="default: the recorded Steps' mode")
    p.add_argument("--preemption-policy", choices=("tail", "cost"), default="tail",
                   help="whom a short step preempts, as the allocator's flag (default tail)")
    p.add_argument("--num-cpu-blocks", type=int, default=None,
                   help="swap space in blocks (default: the recorded pool's; with swap and "
                   "none recorded: as many as --num-blocks)")
    p.add_argument("--num-cpu-cache-blocks", type=int, default=None,
                   help="the prefix cache's CPU tier in blocks, beside the swap space "
                   "(default: the recorded pool's; 0: no tier)")
    p.add_argument("--max-num-seqs", type=_positive, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    p.add_argument("--async-depth", type=int, choices=(1, 2), default=2,
                   help="as the gateway's: 2 plans each step while the last executes")
    p.add_argument("--step-ms", type=float, default=None,
                   help="a fixed step time (default: a model of the batch fitted to the "
                   "recorded Steps' gaps)")
    p.add_argument("--find-min-blocks", action="store_true",
                   help="also find the smallest num_blocks that serves it without preemption")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the figures here")
    return p


def configs(trace: PoolTrace, args: argparse.Namespace) -> list[ReplayConfig]:
    shape = trace.shape
    mode = args.preemption_mode or ("swap" if trace.swap else "recompute")
    step = StepTime(args.step_ms / 1000) if args.step_ms else trace.step_time
    out = []
    for block_size in args.block_size or [shape.block_size]:
        for size in args.num_blocks:
            num_blocks = (size if isinstance(size, int) else
                          max(1, round(size * shape.num_blocks * shape.block_size / block_size)))
            tier = args.num_cpu_cache_blocks
            if tier is None:
                tier = shape.num_cpu_cache_blocks
            cpu = args.num_cpu_blocks  # swap space: the recorded CPU blocks but the tier's
            if cpu is None:
                cpu = (shape.num_cpu_blocks - shape.num_cpu_cache_blocks
                       or (num_blocks if mode == "swap" else 0))
            out.append(ReplayConfig(num_blocks, block_size, mode, cpu + tier,
                                    shape.prefix_caching, args.max_num_seqs,
                                    args.max_num_batched_tokens, step, args.async_depth, tier,
                                    args.preemption_policy))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.step_ms is not None and args.step_ms <= 0:
        parser.error("--step-ms must be > 0")
    if args.num_cpu_blocks is not None and args.num_cpu_blocks < 0:
        parser.error("--num-cpu-blocks must be >= 0")
    if args.num_cpu_cache_blocks is not None and args.num_cpu_cache_blocks < 0:
        parser.error("--num-cpu-cache-blocks must be >= 0")
    try:
        recording = read_recording(args.recording)
    except RecordingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    unknown = sorted(set(args.pool or ()) - recording.pools.keys())
    if unknown:
        print(f"error: no pool {unknown[0]!r} in {args.recording} (it has: "
              f"{', '.join(sorted(recording.pools)) or 'none'})", file=sys.stderr)
        return 2
    for warning in recording.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rows, min_rows = [], []
    results: dict[str, list[ReplayResult]] = {}
    minimums: dict[str, list[MinBlocks]] = {}
    try:
        for pool_id in args.pool or sorted(recording.pools):
            trace = recording.pools[pool_id]
            if trace.num_unfinished:
                print(f"warning: pool {pool_id!r}: {trace.num_unfinished} requests whose end "
                      "the recording does not hold are left out", file=sys.stderr)
            workload = Workload.from_trace(trace)
            rows.append(recorded_row(pool_id, trace))
            for config in configs(trace, args):
                result = replay(workload, config)
                results.setdefault(pool_id, []).append(result)
                rows.append(result_row(pool_id, result))
            if args.find_min_blocks:
                by_block_size = {c.block_size: c for c in configs(trace, args)}
                for config in by_block_size.values():
                    found = find_min_blocks(workload, config)
                    minimums.setdefault(pool_id, []).append(found)
                    min_rows.append(min_row(pool_id, found))
    except ReplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(HEADERS, rows))
    if min_rows:
        print()
        print(markdown(MIN_HEADERS, sorted(min_rows, key=lambda r: (r[0], r[1], r[2]))))
    if args.json:
        write_json(args.json, payload(recording, results, minimums))
    return 0


if __name__ == "__main__":
    sys.exit(main())
