"""KV memory utilisation (issue 5, part 1): paged vs contiguous reservation, no model needed.

    python -m bench.kv_utilisation [--quick]

A saturated server: every request is waiting at t=0 and admitted FCFS as the policy allows;
each step every running request decodes one token (the first comes from its prefill) and a
request leaves when its output is complete. Per step we record the share of reserved KV slots
that hold tokens and the number of running requests, while requests are still waiting
(steady state). Paged policies drive the real allocator core.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from bench.common import RESULTS_DIR, markdown_table, write_results
from bench.kv_policies import ContiguousPolicy, PagedPolicy, SimRequest
from bench.workloads import ALPACA, SHAREGPT, LengthModel, sample_lengths

MAX_LEN = 2048
NUM_SLOTS = 32768


@dataclass
class Trace:
    policy: str
    utilisation: list[float]  # per step while requests were waiting
    concurrency: list[int]
    num_steps: int
    num_preemptions: int


def simulate(policy: ContiguousPolicy | PagedPolicy, lengths) -> Trace:
    waiting = [SimRequest(f"r{i}", L.prompt_len, L.output_len) for i, L in enumerate(lengths)]
    running: list[SimRequest] = []
    utilisation, concurrency, steps = [], [], 0
    while waiting or running:
        outcome = policy.step(running, waiting)
        preempted = {id(r) for r in outcome.preempted}
        for request in running:
            if id(request) not in preempted:
                request.kv += 1
                request.generated += 1
        running = [r for r in running if id(r) not in preempted]
        admitted = {id(r) for r in outcome.admitted}
        for request in outcome.admitted:
            request.kv = request.prompt_len + request.generated
            request.generated += 1
        waiting = outcome.preempted + [r for r in waiting if id(r) not in admitted]
        running += outcome.admitted
        steps += 1
        if waiting:
            reserved = policy.reserved_slots()
            utilisation.append(sum(r.kv for r in running) / reserved if reserved else 1.0)
            concurrency.append(len(running))
        for request in [r for r in running if r.generated >= r.output_len]:
            policy.release(request)
            running.remove(request)
        assert steps < 10_000_000, "simulation does not progress"
    return Trace(
        policy.name, utilisation, concurrency, steps, getattr(policy, "num_preemptions", 0)
    )


def policies() -> list[ContiguousPolicy | PagedPolicy]:
    return [ContiguousPolicy(n, NUM_SLOTS, MAX_LEN) for n in ("max", "pow2", "exact")] + [
        PagedPolicy(NUM_SLOTS, bs) for bs in (1, 8, 16, 32)
    ]


def plot(traces: list[Trace], workload: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for trace in traces:
        n = len(trace.utilisation)
        ax.plot(
            [i / max(1, n - 1) for i in range(n)],
            [100 * u for u in trace.utilisation],
            label=trace.policy,
            linewidth=1,
        )
    ax.set_xlabel("fraction of the saturated run")
    ax.set_ylabel("reserved KV slots holding tokens (%)")
    ax.set_title(f"KV utilisation over time, {workload}-like lengths, {NUM_SLOTS} slots")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right", fontsize=8)
    path = RESULTS_DIR / f"kv_utilisation_{workload}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def run_workload(model: LengthModel, count: int, seed: int) -> tuple[list[list], dict]:
    lengths = sample_lengths(model, count, MAX_LEN, seed)
    traces = [simulate(p, lengths) for p in policies()]
    baseline = statistics.mean(traces[0].concurrency)
    rows, results = [], {}
    for t in traces:
        util, conc = statistics.mean(t.utilisation), statistics.mean(t.concurrency)
        results[t.policy] = {
            "mean_utilisation": util,
            "mean_concurrency": conc,
            "max_concurrency": max(t.concurrency),
            "steps": t.num_steps,
            "preemptions": t.num_preemptions,
        }
        rows.append(
            [
                model.name,
                t.policy,
                f"{100 * util:.1f}%",
                f"{conc:.1f}",
                max(t.concurrency),
                f"{conc / baseline:.2f}x",
                t.num_steps,
                t.num_preemptions,
            ]
        )
    results["plot"] = plot(traces, model.name)
    return rows, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # Enough requests that the pool stays saturated well past the start (Alpaca's are short).
    counts = {SHAREGPT.name: 400, ALPACA.name: 2000} if args.quick else {
        SHAREGPT.name: 2000, ALPACA.name: 10000}
    rows, results = [], {}
    for model in (SHAREGPT, ALPACA):
        model_rows, results[model.name] = run_workload(model, counts[model.name], args.seed)
        rows += model_rows
    table = markdown_table(
        [
            "workload",
            "policy",
            "slots holding tokens",
            "mean running",
            "max running",
            "vs max-reservation",
            "steps",
            "preemptions",
        ],
        rows,
    )
    print(table)
    path = write_results(
        "kv_utilisation",
        {
            "params": {
                "num_slots": NUM_SLOTS,
                "max_len": MAX_LEN,
                "requests": counts,
                "seed": args.seed,
                "workloads": [SHAREGPT.__repr__(), ALPACA.__repr__()],
            },
            "results": results,
            "table": table,
        },
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
