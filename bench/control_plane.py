"""Control plane (issue 5, part 5): where a step's time goes at 8, 64 and 256 running requests.

    python -m bench.control_plane [--quick] [--async-depth 1]
    python -m bench.control_plane --quick --running 64,256 --compare 3   # depth 2 vs depth 1
    python -m bench.control_plane --quick --running 64,256 --compare 3 --baseline untuned-malloc
    git worktree add /tmp/before <commit> && (cd /tmp/before && $OLDPWD/.venv/bin/python \
        -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
        protos/pagedkv/*/v1/*.proto)      # that commit, with its own generated stubs
    python -m bench.control_plane --quick --running 64,256 --compare 3 --baseline tree \
        --baseline-tree /tmp/before       # this gateway and allocator against that commit's

The three services run as usual (models/small-llama, dummy weights), the gateway with
`--step-log`: its engines' own per-step records (gateway/engine/step_stats.py). N streaming
requests (16-token prompts, ignore_eos, greedy) start together; the steps in which all N
decode one token each are kept, and per step we split its time into:

    scheduling      the scheduler's share of the step (planning, applying the allocator's
                    outcome)
    allocator RPC   the Step's round trip (message building, the allocator's work)
    forward, sample the executor's own report
    executor other  executor-side work outside forward/sample (its total less both)
    transport       the Execute's round trip less the executor's total (message building
                    and transport both ways)
    serialization   protobuf encode/decode on the gateway side: only a gateway from before
                    `--step-log`, timed from outside (bench.cp_gateway in that tree), splits
                    it out; the engine's records count it in the two round trips
    outputs/other   the rest of the step: emitting tokens to streams, detokenization, awaits

Control plane = step - forward - sample (everything but the model), where a step is the
executor's period: the time from one Execute response's arrival at the gateway to the next
(`period`). Target: < 10% of the step at 64 running requests.

At async depth 2 (the gateway's default), each Execute goes out before the previous one
returns, and the gateway's work and both round trips overlap the executor's forward pass:
the control plane is the time the executor spends between two forward passes. The gateway's
parts are then off the step's path and reported apart (`off path` ms); on it, "executor
wait" is the period less the executor's own report (its intake of the next call).
At depth 1, a step's parts are timed in the gateway's Engine.step, whose duration is the
period in the steady state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.baselines import BenchRequest
from bench.common import RESULTS_DIR, markdown_table, write_results
from bench.load import read_steps, run_load, stack

MODEL = "models/small-llama"
SEED = 0
PARTS = ("sched", "alloc_rpc", "forward", "sample", "exec_other", "transport", "ser", "other",
         "wait")
LABELS = {"sched": "scheduling", "alloc_rpc": "allocator RPC", "forward": "forward",
          "sample": "sample", "exec_other": "executor other", "transport": "transport",
          "ser": "serialization", "other": "outputs/other", "wait": "executor wait"}


def _split(step: dict[str, float]) -> dict[str, float]:
    ser_alloc, ser_exec = step.get("ser_alloc", 0.0), step.get("ser_exec", 0.0)
    exec_total = step.get("exec_total", step["forward"] + step["sample"])
    if step.get("ahead"):
        # Overlapped with the executor's forward passes: none of the gateway's parts. (Its
        # Engine.step runs from one landing to the next, not from one launch to the next.)
        period = step.get("period", step["total"])
        on_path = {"sched": 0.0, "alloc_rpc": 0.0, "transport": 0.0, "ser": 0.0, "other": 0.0}
        return {
            **on_path, "forward": step["forward"], "sample": step["sample"],
            "exec_other": max(0.0, exec_total - step["forward"] - step["sample"]),
            "wait": max(0.0, period - exec_total), "total": period,
            "control": period - step["forward"] - step["sample"],
            "off_path": step.get("sched", 0.0) + step.get("alloc", 0.0) + ser_exec,
            "period": period,
        }
    parts = {
        "sched": step.get("sched", 0.0),
        "forward": step["forward"],
        "sample": step["sample"],
        "exec_other": max(0.0, exec_total - step["forward"] - step["sample"]),
        "ser": ser_alloc + ser_exec,
    }
    # encode/decode happen inside the two client calls: taken out of both
    parts["transport"] = max(0.0, step.get("exec", 0.0) - exec_total - ser_exec)
    parts["alloc_rpc"] = max(0.0, step.get("alloc", 0.0) - ser_alloc)
    parts["other"] = max(0.0, step["total"] - sum(parts.values()))
    parts["wait"] = 0.0  # the executor waits through all of the above
    parts["off_path"] = 0.0
    parts["total"] = step["total"]
    parts["period"] = step.get("period", step["total"])  # the same in the steady state
    parts["control"] = step["total"] - step["forward"] - step["sample"]
    return parts


def measure(sizes: list[int], max_tokens: dict[int, int],
            executor_flags: tuple[str, ...] = (), gateway_flags: tuple[str, ...] = (),
            gateway_tree: str | None = None) -> list[dict[str, Any]]:
    """One stack (a fresh gateway with `gateway_flags`, run from `gateway_tree` when given,
    the executor with `executor_flags` added): every size in turn."""
    log_dir = tempfile.mkdtemp(prefix="pagedkv-cp-")
    step_log = str(Path(log_dir) / "steps.jsonl")
    rows = []
    executor_args = ("--num-blocks", "8192", "--max-num-seqs", "512",
                     "--max-num-batched-tokens", "8192", *executor_flags)
    gateway_args = ("--max-num-seqs", "512", "--max-num-batched-tokens", "8192",
                    *gateway_flags)
    with stack(MODEL, executor_args, gateway_args, SEED, log_dir, step_log,
               gateway_tree=gateway_tree) as running:
        run_load(running.gateway_addr, [BenchRequest([1, 5, 6, 7], 8)] * 4, 4)  # warm-up
        for n in tqdm(sizes, desc="control plane", file=sys.stderr):
            _, offset = read_steps(step_log, 0)
            reqs = [BenchRequest([1, *[(i * 13 + j) % 30000 + 3 for j in range(15)]],
                                 max_tokens.get(n, 64)) for i in range(n)]
            t0 = time.perf_counter()
            results, wall = run_load(running.gateway_addr, reqs, concurrency=n)
            time.sleep(0.2)
            steps, _ = read_steps(step_log, offset)
            full = [s for s in steps if s.get("seqs") == n and s.get("num_tokens", n) == n]
            if not full:
                rows.append({"running": n, "steps": 0})
                continue
            splits = [_split(s) for s in full]
            med = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            share = statistics.median(s["control"] / s["total"] for s in splits)
            rows.append({"running": n, "steps": len(full), "median_ms": med,
                         "control_share": share, "wall_s": wall,
                         "tok_per_s": sum(len(r.tokens) for r in results) / wall,
                         "completed": sum(r.ok for r in results), "elapsed_s":
                         time.perf_counter() - t0, "gateway_flags": list(gateway_flags),
                         "gateway_tree": gateway_tree})
    return rows


# What --compare runs against: (label, executor flags, gateway flags, from --baseline-tree),
# the default first.
BASELINES = {
    "depth-1": (("depth 2", (), (), False), ("depth 1", (), ("--async-depth", "1"), False)),
    "untuned-malloc": (("malloc tuned", (), (), False),
                       ("malloc untuned", ("--tune-malloc", "false"), (), False)),
    "tree": (("this tree", (), (), False), ("baseline tree", (), (), True)),
}
# Where each comparison's figures go (bench/results/<name>.json).
RESULTS_NAMES = {"depth-1": "control_plane_depth", "untuned-malloc": "control_plane_malloc",
                 "tree": "control_plane_vs_tree"}


def compare(sizes: list[int], max_tokens: dict[int, int], pairs: int,
            baseline: str = "depth-1", baseline_tree: str | None = None) -> list[dict[str, Any]]:
    """The defaults against `baseline` (BASELINES), `pairs` runs of each, interleaved; a table
    of the per-run figures and their medians."""
    variants = BASELINES[baseline]
    runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for label, *_ in variants}
    for _ in range(pairs):
        for label, flags, gateway_flags, from_tree in variants:
            runs[label].append(measure(sizes, max_tokens, flags, gateway_flags,
                                       baseline_tree if from_tree else None))
    headers = ["running", "steps", "control plane ms (runs)", "median", "share",
               "forward + sample ms", "step ms", "period ms", "off path ms", "tok/s"]
    print(f"### Control plane: {variants[0][0]} against {variants[1][0]} (interleaved runs)\n")
    summary = []
    for n in sizes:
        body = []
        for label, flags, gateway_flags, from_tree in variants:
            rows = [r for run in runs[label] for r in run if r["running"] == n and r["steps"]]
            if not rows:
                continue

            def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return statistics.median(r["median_ms"][key] for r in rows)

            controls = [r["median_ms"]["control"] for r in rows]
            entry = {
                "running": n, "variant": label,
                "gateway_tree": baseline_tree if from_tree else None,
                "executor_flags": list(flags), "gateway_flags": list(gateway_flags),
                "control_ms": controls,
                "control_median_ms": statistics.median(controls),
                "share": statistics.median(r["control_share"] for r in rows),
                "forward_sample_ms": med("forward") + med("sample"), "step_ms": med("total"),
                "off_path_ms": med("off_path"), "period_ms": med("period"),
                "tok_per_s": statistics.median(r["tok_per_s"] for r in rows),
            }
            summary.append(entry)
            body.append([f"{n}, {label}",
                         sum(r["steps"] for r in rows),
                         " / ".join(f"{c:.2f}" for c in controls),
                         f"{entry['control_median_ms']:.2f}", f"{entry['share']:.1%}",
                         f"{entry['forward_sample_ms']:.2f}", f"{entry['step_ms']:.2f}",
                         f"{entry['period_ms']:.2f}", f"{entry['off_path_ms']:.2f}",
                         f"{entry['tok_per_s']:.0f}"])
        print(markdown_table(headers, body) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--running", default="8,64,256")
    p.add_argument("--threads", type=int, default=1, help="executor torch threads")
    p.add_argument("--async-depth", default="2", choices=("1", "2"),
                   help="the gateway's --async-depth")
    p.add_argument("--compare", type=int, default=0, metavar="PAIRS",
                   help="instead: PAIRS interleaved runs each of the defaults and --baseline")
    p.add_argument("--baseline", default="depth-1", choices=sorted(BASELINES),
                   help="with --compare: a gateway at --async-depth 1, an executor with "
                   "--tune-malloc false, or the gateway of --baseline-tree")
    p.add_argument("--name", default=None,
                   help="with --compare: bench/results/<name>.json (default: after --baseline)")
    p.add_argument("--baseline-tree", default=None, metavar="DIR",
                   help="with --baseline tree: a checkout of another commit (with its own "
                   "generated stubs) whose gateway and allocator run against this tree's")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sizes = [int(x) for x in args.running.split(",")]
    max_tokens = {8: 64, 64: 48, 256: 32} if args.quick else {8: 128, 64: 128, 256: 96}
    if args.baseline == "tree" and not args.baseline_tree:
        p.error("--baseline tree needs --baseline-tree DIR")
    if args.compare:
        summary = compare(sizes, max_tokens, args.compare, args.baseline, args.baseline_tree)
        name = args.name or RESULTS_NAMES[args.baseline]
        write_results(name, {
            "benchmark": name, "model": MODEL, "seed": SEED, "baseline": args.baseline,
            "quick": args.quick, "torch_threads": args.threads, "max_tokens": max_tokens,
            "pairs": args.compare, "baseline_tree": args.baseline_tree, "rows": summary,
        })
        return 0
    rows = measure(sizes, max_tokens, gateway_flags=("--async-depth", args.async_depth))
    headers = ["running", "steps", "step ms", *[LABELS[k] + " ms" for k in PARTS],
               "control plane ms", "control share", "off path ms"]
    body = []
    for r in rows:
        if not r["steps"]:
            body.append([r["running"], 0] + ["-"] * (len(headers) - 2))
            continue
        m = r["median_ms"]
        body.append([r["running"], r["steps"], f"{m['total']:.2f}",
                     *[f"{m[k]:.2f}" for k in PARTS], f"{m['control']:.2f}",
                     f"{r['control_share']:.1%}", f"{m['off_path']:.2f}"])
    print("### Control plane: per-step split (medians over the steps where all N decode)\n")
    print(markdown_table(headers, body))
    at64 = next((r for r in rows if r["running"] == 64 and r["steps"]), None)
    if at64:
        met = at64["control_share"] < 0.10
        print(f"\nTarget control plane < 10% of step time at 64 running: "
              f"{at64['control_share']:.1%} - {'met' if met else 'MISSED'}")
    try:
        plots = plot(rows)
    except Exception as exc:  # noqa: BLE001 - a plot must not lose the figures
        print(f"plot failed: {exc!r}", file=sys.stderr)
        plots = []
    write_results("control_plane", {
        "benchmark": "control_plane", "model": MODEL, "seed": SEED, "quick": args.quick,
        "torch_threads": args.threads, "max_tokens": max_tokens, "rows": rows,
        "parts": LABELS, "plots": plots, "async_depth": int(args.async_depth),
    })
    return 0


def plot(rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["steps"]]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [str(r["running"]) for r in rows]
    bottom = [0.0] * len(rows)
    for key in PARTS:
        values = [r["median_ms"][key] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=LABELS[key])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("running requests (all decoding)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("Where a decode step's time goes (small-llama, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = str(RESULTS_DIR / "control_plane.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    raise SystemExit(main())
