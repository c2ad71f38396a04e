"""End-to-end serving (issue 5, part 2): pagedkv through its gRPC stack vs transformers.

    python -m bench.serving [--quick] [--repeats N]

Workloads (seeded; prompt token ids are BOS + uniform ids in [3, vocab)):
  mixed  prompts log-normal, median 120 tokens, sigma 0.6, clipped to 16..512; outputs
         log-normal, median 60, sigma 0.6, clipped to 8..256. Every request stops at its own
         length (greedy, ignore_eos, max_tokens = its length).
  equal  128 prompt tokens -> 64 new for every request (static batching's best case).

Systems, same model (models/small-llama) and the same dummy weights (seeded init), fp32,
greedy:
  pagedkv     allocator + executor + gateway as subprocesses; a gRPC streaming client per
              request (closed loop: `c` clients; open loop: Poisson arrivals).
  generate    transformers `model.generate`, static batches of `c` requests in arrival order,
              left padding, each batch runs to its longest output; only each request's own
              tokens count. Open loop: a batch of whatever has arrived when the last finished.
  cb          transformers continuous batching (`continuous_batching_context_manager`,
              per-request max_new_tokens, EOS off), `c` in flight (open loop: added on arrival).
Baselines run in this process at each of `--baseline-threads` torch threads (1 and 2 by
default), after the same warm-up as pagedkv; each is reported at its fastest (median tok/s),
with the thread count it used. The executor runs with `--threads` (OMP_NUM_THREADS,
inherited; default 1: on 2 shared cores that also carry the gateway, the allocator and this
client, runs with 2 swung widely).
Systems are interleaved (order rotated per repeat) and medians over repeats are reported.

Token check: every system's tokens are compared with `generate`'s for the same requests; where
any two systems disagree the request is re-run alone (batch 1, no padding) as the oracle.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.baselines import (
    BenchRequest,
    RequestResult,
    oracle_greedy,
    reference_model,
    run_continuous,
    run_generate,
)
from bench.common import RESULTS_DIR, markdown_table, percentile, write_results
from bench.load import poisson_arrivals, read_steps, run_load, stack
from bench.workloads import bounded_lognormal

MODEL = "models/small-llama"
VOCAB = 32000
SEED = 0
SYSTEMS = ("pagedkv", "generate", "cb")
TORCH_THREADS = 1  # see --threads


def mixed_requests(count: int, seed: int = SEED) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt_len = bounded_lognormal(rng, 120, 0.6, 16, 512)
        output_len = bounded_lognormal(rng, 60, 0.6, 8, 256)
        out.append(BenchRequest([1, *(rng.randrange(3, VOCAB) for _ in range(prompt_len - 1))],
                                output_len))
    return out


def equal_requests(count: int, prompt_len: int = 128, output_len: int = 64,
                   seed: int = SEED + 1) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([1, *(rng.randrange(3, VOCAB) for _ in range(prompt_len - 1))],
                         output_len) for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    workload: str           # mixed | equal
    num_requests: int
    concurrency: int        # closed loop; for open loop the batch cap of `generate`
    open_loop: bool = False
    rate_per_s: float = 0.0  # open loop: Poisson arrivals (0: chosen from the c64 run)


def scenarios(quick: bool, open_rate: float) -> list[Scenario]:
    if quick:
        # c64 gets two waves: with exactly 64 requests nothing refills the batch
        plan = [("mixed", 1, 4), ("mixed", 8, 16), ("mixed", 32, 32), ("mixed", 64, 128),
                ("equal", 64, 64)]
        open_n = 32
    else:
        plan = [("mixed", 1, 8), ("mixed", 8, 48), ("mixed", 32, 128), ("mixed", 64, 192),
                ("equal", 8, 32), ("equal", 64, 128)]
        open_n = 128
    out = [Scenario(f"{w}-c{c}", w, n, c) for w, c, n in plan]
    out.append(Scenario("mixed-poisson", "mixed", open_n, 64, True, open_rate))
    return out


def requests_for(s: Scenario) -> list[BenchRequest]:
    reqs = mixed_requests(s.num_requests) if s.workload == "mixed" else equal_requests(
        s.num_requests)
    if s.open_loop:
        for r, t in zip(reqs, poisson_arrivals(len(reqs), s.rate_per_s, SEED + 7), strict=True):
            r.arrival_s = t
    return reqs


def run_generate_open(model: Any, requests: list[BenchRequest], cap: int
                      ) -> tuple[list[RequestResult], float]:
    """A static-batching server: each batch is what has arrived when the last one finished."""
    results: list[RequestResult] = [RequestResult() for _ in requests]
    start = time.perf_counter()
    i = 0
    while i < len(requests):
        now = time.perf_counter() - start
        if requests[i].arrival_s > now:
            time.sleep(requests[i].arrival_s - now)
            now = time.perf_counter() - start
        j = i
        while j < len(requests) and j - i < cap and requests[j].arrival_s <= now:
            j += 1
        batch_results, _ = run_generate(model, requests[i:j], j - i)
        for k, res in enumerate(batch_results):
            for attr in ("first_s", "last_s"):
                setattr(res, attr, getattr(res, attr) + now)
            res.sent_s = requests[i + k].arrival_s
            results[i + k] = res
        i = j
    return results, time.perf_counter() - start


# Launched ahead, a wait of the executor longer than this between two steps is the engine
# running out of work (counted as between steps), not control plane.
IDLE_WAIT_MS = 10.0


def _step_span(x: dict[str, float]) -> float:
    """The wall time a step accounts for. Launched ahead, a gateway step does not span its
    batch's execution: the batch's forward + sample + the executor's wait before it (from
    the period between two responses), when that wait is not idleness."""
    if not x.get("ahead") or "period" not in x:
        return x["total"]
    busy = x.get("exec_total", x["forward"] + x["sample"])
    wait = x["period"] - busy
    return busy + (wait if 0 <= wait < IDLE_WAIT_MS else 0.0)


def step_profile(steps: list[dict[str, float]], wall_s: float) -> dict[str, float | None]:
    """Where pagedkv's wall time went, from the gateway's own per-step records."""
    if not steps:
        return {}
    total = sum(map(_step_span, steps))
    forward = sum(x["forward"] for x in steps)
    sample = sum(x["sample"] for x in steps)
    decode = [x for x in steps if x.get("num_tokens") == x.get("seqs")]
    # (A call launched ahead also waits for the one before: no overhead figure from it.)
    in_turn = [x for x in steps if not x.get("ahead")]
    return {
        "steps": len(steps),
        "mean_seqs": statistics.fmean(x.get("seqs", 0) for x in steps),
        "decode_only_steps": len(decode),
        "busy_share": total / (wall_s * 1e3),
        "forward_share": forward / (wall_s * 1e3),
        "sample_share": sample / (wall_s * 1e3),
        "control_share": (total - forward - sample) / (wall_s * 1e3),
        "allocator_ms_per_step": sum(x.get("alloc", 0.0) for x in steps) / len(steps),
        "execute_overhead_ms_per_step": (
            sum(x.get("exec", 0.0) - x["forward"] - x["sample"] for x in in_turn) / len(in_turn)
            if in_turn else None
        ),
        "sched_ms_per_step": sum(x.get("sched", 0.0) for x in steps) / len(steps),
        "step_ms_mean": total / len(steps),
    }


def run_system(system: str, s: Scenario, reqs: list[BenchRequest], model: Any,
               gateway_addr: str) -> tuple[list[RequestResult], float]:
    if system == "pagedkv":
        bar = tqdm(total=len(reqs), desc=f"pagedkv {s.name}", leave=False, file=sys.stderr)
        try:
            return run_load(gateway_addr, reqs, s.concurrency, s.open_loop, progress=bar)
        finally:
            bar.close()
    if system == "generate":
        if s.open_loop:
            return run_generate_open(model, reqs, s.concurrency)
        return run_generate(model, reqs, s.concurrency)
    return run_continuous(model, reqs, None if s.open_loop else s.concurrency,
                          open_loop=s.open_loop)


def summarise(results: list[RequestResult], wall_s: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    tpot = [t * 1e3 for r in ok if (t := r.tpot_s) is not None]
    return {
        "wall_s": wall_s,
        "completed": len(ok),
        "requests": len(results),
        "output_tokens": sum(len(r.tokens) for r in ok),
        "tok_per_s": sum(len(r.tokens) for r in ok) / wall_s,
        "ttft_p50_ms": percentile(ttft, 50) if ttft else float("nan"),
        "ttft_p99_ms": percentile(ttft, 99) if ttft else float("nan"),
        "tpot_p50_ms": percentile(tpot, 50) if tpot else float("nan"),
        "tpot_p99_ms": percentile(tpot, 99) if tpot else float("nan"),
    }


def check_tokens(model: Any, reqs: list[BenchRequest],
                 outputs: dict[str, list[RequestResult]]) -> dict[str, Any]:
    """Match rates against `generate`, and against the batch-1 oracle where systems differ."""
    ref = outputs["generate"]
    report: dict[str, Any] = {}
    for system in SYSTEMS:
        same = sum(a.tokens == b.tokens for a, b in zip(outputs[system], ref, strict=True))
        report[f"{system}_match_generate"] = same / len(reqs)
    disputed = [i for i in range(len(reqs))
                if len({tuple(outputs[s][i].tokens) for s in SYSTEMS}) > 1]
    oracle_hits = dict.fromkeys(SYSTEMS, 0)
    examples = []
    for i in disputed[:16]:  # bounded: each oracle run is a batch-1 generate
        truth = oracle_greedy(model, reqs[i].prompt, reqs[i].output_len)
        for system in SYSTEMS:
            got = outputs[system][i].tokens
            oracle_hits[system] += got == truth
            if got != truth and len(examples) < 6:
                first = next((k for k, (a, b) in enumerate(zip(got, truth, strict=False))
                              if a != b), min(len(got), len(truth)))
                examples.append({"request": i, "system": system, "first_diff_at": first,
                                 "prompt_len": len(reqs[i].prompt)})
    report["disputed_requests"] = len(disputed)
    report["oracle_checked"] = min(len(disputed), 16)
    report["oracle_matches"] = oracle_hits
    report["oracle_mismatch_examples"] = examples
    return report


def plot(rows: list[dict[str, Any]], path_prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [r for r in rows if r["workload"] == "mixed" and not r["open_loop"]]
    if not closed:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for system in SYSTEMS:
        pts = sorted(((r["concurrency"], r[system]) for r in closed), key=lambda t: t[0])
        xs = [c for c, _ in pts]
        axes[0].plot(xs, [m["tok_per_s"] for _, m in pts], marker="o", label=system)
        axes[1].plot(xs, [m["ttft_p50_ms"] for _, m in pts], marker="o", label=system)
        axes[2].plot(xs, [m["tpot_p50_ms"] for _, m in pts], marker="o", label=system)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.suptitle("small-llama, mixed lengths, CPU (2 cores): pagedkv vs transformers")
    fig.tight_layout()
    path = f"{path_prefix}_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _median_metrics(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(m[k] for m in samples) for k in samples[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests, one repeat")
    p.add_argument("--repeats", type=int, default=None, help="default: 1 quick, 3 full")
    p.add_argument("--open-rate", type=float, default=None,
                   help="Poisson requests/s (default: 70%% of pagedkv's mixed-c64 rate)")
    p.add_argument("--only", default="", help="comma-separated scenario names to run")
    p.add_argument("--name", default="serving",
                   help="results name: bench/results/<name>.json and <name>_*.png")
    p.add_argument("--threads", type=int, default=TORCH_THREADS,
                   help="torch threads of the baselines and of the executor (OMP_NUM_THREADS); "
                        "1 by default: with 2 on 2 shared cores, OpenMP spin-waiting makes "
                        "runs swing up to 10x")
    p.add_argument("--baseline-threads", default="1,2",
                   help="torch thread counts tried for each baseline; the fastest (median "
                        "tok/s) is reported, so a ratio is always against its best")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    baseline_threads = [int(t) for t in args.baseline_threads.split(",")]
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the executor
    load_before = os.getloadavg()
    model = reference_model(MODEL, SEED)
    warm = mixed_requests(8, seed=99)
    for threads in baseline_threads:  # the same warm-up as pagedkv's below, per thread count
        torch.set_num_threads(threads)
        run_generate(model, warm, 8)
        run_continuous(model, warm, 8)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    step_log = str(Path(tempfile.mkdtemp(prefix="pagedkv-serving-")) / "steps.jsonl")
    with stack(MODEL, seed=SEED, step_log=step_log) as running:
        addr = running.gateway_addr
        run_load(addr, mixed_requests(8, seed=99), concurrency=8)  # warm-up
        plan = scenarios(args.quick, args.open_rate or 0.0)
        if args.only:
            plan = [s for s in plan if s.name in args.only.split(",")]
        for s in plan:
            if s.open_loop and not s.rate_per_s:
                base = next((r for r in rows if r["scenario"] == "mixed-c64"), None)
                req_rate = (base["pagedkv"]["completed"] / base["pagedkv"]["wall_s"]
                            if base else 2.0)
                s = Scenario(s.name, s.workload, s.num_requests, s.concurrency, True,
                             round(0.7 * req_rate, 3))
            reqs = requests_for(s)
            # Baselines: one sample list per thread count, "generate@2"; pagedkv: "pagedkv".
            samples: dict[str, list[dict[str, float]]] = {}
            profiles: list[dict[str, float]] = []
            outputs: dict[str, list[RequestResult]] = {}
            for rep in range(repeats):
                order = SYSTEMS[rep % 3:] + SYSTEMS[:rep % 3]
                runs = [(system, threads) for system in order
                        for threads in ([None] if system == "pagedkv" else baseline_threads)]
                for system, threads in runs:
                    key = system if threads is None else f"{system}@{threads}"
                    print(f"[serving] {s.name} rep {rep + 1}/{repeats}: {key}",
                          file=sys.stderr, flush=True)
                    if threads is not None:
                        torch.set_num_threads(threads)
                    _, offset = read_steps(step_log)
                    results, wall = run_system(system, s, reqs, model, addr)
                    if system == "pagedkv":
                        time.sleep(0.1)
                        profiles.append(step_profile(read_steps(step_log, offset)[0], wall))
                    samples.setdefault(key, []).append(summarise(results, wall))
                    outputs[system] = results
                    failed = [r.error for r in results if not r.ok]
                    if failed:
                        print(f"[serving] {key} {s.name}: {len(failed)} failed, e.g. "
                              f"{failed[0]}", file=sys.stderr)
            row: dict[str, Any] = {
                "scenario": s.name, "workload": s.workload, "concurrency": s.concurrency,
                "num_requests": s.num_requests, "open_loop": s.open_loop,
                "rate_per_s": s.rate_per_s,
                "mean_prompt": statistics.fmean(len(r.prompt) for r in reqs),
                "mean_output": statistics.fmean(r.output_len for r in reqs),
                "samples": samples, "pagedkv_steps": profiles,
            }
            row["pagedkv"] = _median_metrics(samples["pagedkv"])
            for system in SYSTEMS[1:]:
                best = max(baseline_threads, key=lambda t, name=system: _median_metrics(
                    samples[f"{name}@{t}"])["tok_per_s"])
                row[system] = _median_metrics(samples[f"{system}@{best}"])
                row[f"{system}_threads"] = best
            row["tokens"] = check_tokens(model, reqs, outputs)
            rows.append(row)
            _print_row(row)
    elapsed = time.perf_counter() - started
    table = render(rows)
    print(table)
    payload = {
        "benchmark": "serving", "model": MODEL, "seed": SEED, "quick": args.quick,
        "repeats": repeats, "torch_threads": args.threads,
        "baseline_threads_tried": baseline_threads,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "workloads": {"mixed": "prompt LN(median 120, sigma 0.6) in [16, 512]; output "
                               "LN(median 60, sigma 0.6) in [8, 256]",
                      "equal": "128 -> 64"},
        "targets": targets(rows), "rows": rows, "elapsed_s": elapsed,
    }
    write_results(args.name, payload)  # first: a plotting failure must not lose the figures
    payload["plots"] = plot(rows, str(RESULTS_DIR / args.name))
    write_results(args.name, payload)
    return 0


def _print_row(row: dict[str, Any]) -> None:
    parts = [f"{s} {row[s]['tok_per_s']:.0f} tok/s" for s in SYSTEMS]
    print(f"[serving] {row['scenario']}: " + ", ".join(parts), file=sys.stderr, flush=True)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def ratio(name: str, base: str) -> float | None:
        row = next((r for r in rows if r["scenario"] == name), None)
        if row is None:
            return None
        return row["pagedkv"]["tok_per_s"] / row[base]["tok_per_s"]

    for name, base, goal in (("mixed-c64", "generate", 2.0), ("mixed-c64", "cb", 1.5),
                             ("equal-c64", "generate", 0.8)):
        value = ratio(name, base)
        if value is not None:
            out.append({"scenario": name, "vs": base, "target": goal,
                        "ratio": round(value, 3), "met": value >= goal})
    return out


def render(rows: list[dict[str, Any]]) -> str:
    headers = ["scenario", "system", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "TPOT p99 ms", "done", "tokens = generate"]
    body = []
    for row in rows:
        label = row["scenario"] + (f" ({row['rate_per_s']:.2f} req/s)" if row["open_loop"]
                                   else "")
        for system in SYSTEMS:
            m = row[system]
            name = system if system == "pagedkv" else f"{system} ({row[f'{system}_threads']}t)"
            body.append([label, name, f"{m['tok_per_s']:.0f}", f"{m['ttft_p50_ms']:.0f}",
                         f"{m['ttft_p99_ms']:.0f}", f"{m['tpot_p50_ms']:.1f}",
                         f"{m['tpot_p99_ms']:.1f}", f"{m['completed']:.0f}/{m['requests']:.0f}",
                         f"{row['tokens'][f'{system}_match_generate']:.0%}"])
    out = ["### Serving: small-llama, CPU, medians over repeats", "",
           markdown_table(headers, body), ""]
    t = targets(rows)
    if t:
        out += ["### Serving targets (pagedkv tok/s ratio)", "",
                markdown_table(["scenario", "vs", "target", "ratio", "met"],
                               [[x["scenario"], x["vs"], f">= {x['target']}x",
                                 f"{x['ratio']:.2f}x", "yes" if x["met"] else "NO"]
                                for x in t]), ""]
    checks = [[r["scenario"], r["tokens"]["disputed_requests"], r["tokens"]["oracle_checked"],
               ", ".join(f"{k} {v}" for k, v in r["tokens"]["oracle_matches"].items())]
              for r in rows]
    out += ["### Token check (requests where systems disagree; batch-1 oracle)", "",
            markdown_table(["scenario", "disputed", "oracle-checked", "matches oracle"],
                           checks), ""]
    prof = []
    for r in rows:
        if not r.get("pagedkv_steps") or not r["pagedkv_steps"][-1]:
            continue
        x = r["pagedkv_steps"][-1]
        prof.append([r["scenario"], x["steps"], f"{x['mean_seqs']:.1f}",
                     f"{x['step_ms_mean']:.1f}", f"{x['forward_share']:.0%}",
                     f"{x['sample_share']:.0%}", f"{x['control_share']:.0%}",
                     f"{1 - x['busy_share']:.0%}", f"{x['allocator_ms_per_step']:.2f}",
                     "-" if x["execute_overhead_ms_per_step"] is None
                     else f"{x['execute_overhead_ms_per_step']:.2f}"])
    if prof:
        out += ["### Where pagedkv's wall time went (gateway step timers, last repeat)", "",
                markdown_table(["scenario", "steps", "mean batch", "step ms", "forward",
                                "sample", "control plane", "between steps",
                                "allocator ms/step", "Execute overhead ms/step"], prof)]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
