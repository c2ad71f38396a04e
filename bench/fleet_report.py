"""The fleet benchmark's figures: one row per routing policy from the clients' outcomes and
two snapshots of the services (bench.fleet), its table and its plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common import percentile
from bench.fleet_client import Driver
from bench.fleet_metrics import (
    Snapshot,
    by_pool,
    cores_used,
    executors_busy,
    quantile_ms,
    total,
)


def summarise(driver: Driver, before: Snapshot, after: Snapshot) -> dict[str, Any]:
    start, end = before.at - driver.origin, after.at - driver.origin
    window = end - start
    outcomes = driver.outcomes
    failed = [o for o in outcomes if o.error is not None]
    measured = [o for o in outcomes if start <= o.sent_s < end and o.error is None]
    # A request still without its first token when cut: its TTFT is at least this.
    ttft = [(o.first_s if o.first_s is not None else o.cut_s or driver.now()) - o.sent_s
            for o in measured]
    itl = [(o.last_s - o.first_s) / (o.num_tokens - 1) * 1e3 for o in measured
           if o.first_s is not None and o.last_s is not None and o.num_tokens > 1]
    finished = [o for o in measured if o.num_cached is not None]
    prompt = sum(o.num_prompt for o in finished)
    a, b = after.allocator, before.allocator

    def delta(name: str, **labels: str) -> float:
        return total(a, name, **labels) - total(b, name, **labels)

    queries = delta("pagedkv_allocator_prefix_cache_queries_total")
    pool_before = by_pool(b, "pagedkv_allocator_prefix_cache_queries_total")
    per_pool = [v - pool_before.get(p, 0.0)
                for p, v in by_pool(a, "pagedkv_allocator_prefix_cache_queries_total").items()]

    def gateways_delta(name: str) -> float:
        return (sum(total(g, name) for g in after.gateways)
                - sum(total(g, name) for g in before.gateways))

    phase = "pagedkv_step_phase_seconds"
    busy = executors_busy(before, after)
    return {
        "requests_sent": len(outcomes),
        "completed": sum(o.num_cached is not None for o in outcomes),
        "failed": len(failed),
        "cut_at_end": sum(o.cut_s is not None for o in outcomes),
        "errors": sorted({o.error for o in failed if o.error})[:10],
        "measured_requests": len(measured),
        "window_s": round(window, 2),
        "hit_rate_allocator": _ratio(delta("pagedkv_allocator_prefix_cache_hits_total"),
                                     queries),
        "hit_rate_gateways": _ratio(gateways_delta("vllm:prefix_cache_hits_total"),
                                    gateways_delta("vllm:prefix_cache_queries_total")),
        "hit_rate_clients": _ratio(sum(o.num_cached or 0 for o in finished), prompt),
        "hit_rate_ideal": _ratio(sum(o.num_system_tokens for o in finished), prompt),
        "ttft_p50_s": _q(ttft, 50), "ttft_p99_s": _q(ttft, 99),
        "ttft_censored": sum(o.first_s is None for o in measured),
        "itl_p50_ms": _q(itl, 50), "itl_p99_ms": _q(itl, 99),
        "output_tok_s": round(sum(driver.tokens_per_s[int(start):int(end)])
                              / (int(end) - int(start)), 1),
        "requests_per_s": round(len(measured) / window, 2),
        "steps_per_s": round(delta("pagedkv_rpc_duration_seconds_count", method="Step")
                             / window, 1),
        "match_prefix_per_s": round(
            delta("pagedkv_rpc_duration_seconds_count", method="MatchPrefix") / window, 1),
        "allocator_step_p99_ms_at_most": quantile_ms(
            [b], [a], "pagedkv_rpc_duration_seconds", 0.99, method="Step"),
        "allocator_match_prefix_p99_ms_at_most": quantile_ms(
            [b], [a], "pagedkv_rpc_duration_seconds", 0.99, method="MatchPrefix"),
        "executors_busy": busy,
        "executor_busy_mean": round(statistics.mean(busy), 3),
        # A gateway's step period less its batch's compute: on an executor that several
        # gateways share, the wait for the others' batches is in it.
        "gateway_control_plane_p50_ms_at_most": quantile_ms(
            before.gateways, after.gateways, phase, 0.5, phase="control_plane"),
        "preemptions": delta("pagedkv_allocator_preemptions_total"),
        "busiest_pool_vs_mean": round(max(per_pool) / statistics.mean(per_pool), 2)
        if per_pool and statistics.mean(per_pool) else None,
        "cores_used": cores_used(before, after),
        "tokens_per_s_series": driver.tokens_per_s,
        "ttft_s_samples": [round(x, 4) for x in ttft],
    }


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _q(samples: list[float], q: float) -> float | None:
    return round(percentile(samples, q), 4) if samples else None


TABLE = ["policy", "hit rate (allocator)", "clients' hits / ideal", "TTFT p50 / p99 s",
         "ITL p50 / p99 ms", "output tok/s", "completed / failed", "Steps/s",
         "Step p99 <= ms", "preemptions", "busiest pool / mean",
         "cores: client / gateways / allocator / executors / machine"]


def table_row(r: dict[str, Any]) -> list[Any]:
    cores = r["cores_used"]
    censored = ">= " if r["ttft_censored"] > 0.01 * r["measured_requests"] else ""
    return [r["policy"], f"{r['hit_rate_allocator']:.1%}",
            f"{r['hit_rate_clients'] / r['hit_rate_ideal']:.0%}",
            f"{r['ttft_p50_s']:.2f} / {censored}{r['ttft_p99_s']:.1f}",
            f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}", f"{r['output_tok_s']:,.0f}",
            f"{r['completed']:,} / {r['failed']}", f"{r['steps_per_s']:,.0f}",
            f"{r['allocator_step_p99_ms_at_most']:g}",
            f"{r['preemptions']:,.0f}",
            f"{r['busiest_pool_vs_mean']:.2f}",
            " / ".join(f"{cores.get(k, 0.0):.2f}"
                       for k in ("client", "gateway", "allocator", "executor", "machine"))]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    axes[0].bar(names, [r["hit_rate_allocator"] for r in rows])
    axes[0].axhline(rows[0]["hit_rate_ideal"], linestyle="--", color="gray", label="ideal")
    axes[0].set_title("prefix-cache hit rate (allocator)")
    axes[0].legend()
    for r in rows:  # the TTFT distribution of the window's requests
        samples = sorted(r["ttft_s_samples"])
        axes[1].plot(samples, [(i + 1) / len(samples) for i in range(len(samples))],
                     label=r["policy"])
    axes[1].set_xscale("log")
    axes[1].set_title("TTFT CDF (s, wall)")
    axes[1].legend()
    axes[2].bar(names, [r["output_tok_s"] for r in rows])
    axes[2].set_title("output tokens/s (window)")
    for r in rows:  # a 5 s moving mean: a batch lands every few hundred ms per gateway
        series = r["tokens_per_s_series"]
        axes[3].plot([sum(series[max(0, i - 4):i + 1]) / min(i + 1, 5)
                      for i in range(len(series))], label=r["policy"])
    axes[3].set_title("output tokens/s over the run (5 s mean)")
    axes[3].set_xlabel("s")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
