"""The replay's figures: a markdown table on stdout, the same as JSON (`--json OUT`, written
whole or not at all)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.replay.records import PoolTrace, Recording
from tools.replay.search import MinBlocks
from tools.replay.simulator import ReplayResult

HEADERS = ["pool", "run", "num_blocks", "block_size", "preemption", "requests", "steps",
           "simulated s", "peak used", "mean used", "prefix hit rate", "preemptions",
           "swap-outs", "replay s", "steps/s"]
MIN_HEADERS = ["pool", "block_size", "preemption", "smallest num_blocks without preemption",
               "its tokens", "probes", "search s"]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def recorded_row(pool_id: str, trace: PoolTrace) -> list[Any]:
    run, shape = trace.recorded, trace.shape
    hit = run.num_prefix_hits / run.num_prefix_queries if run.num_prefix_queries else None
    mean = run.sum_used_blocks / max(run.num_steps, 1) / shape.num_blocks
    return [pool_id, "recorded", shape.num_blocks, shape.block_size,
            "swap" if trace.swap else "recompute", len(trace.requests), run.num_steps,
            f"{run.duration_s:.1f}", _percent(run.peak_used_blocks / shape.num_blocks),
            _percent(mean), _percent(hit), run.num_preemptions, run.num_swaps, "-", "-"]


def result_row(pool_id: str, result: ReplayResult) -> list[Any]:
    c = result.config
    mode = c.preemption_mode if c.preemption_policy == "tail" else (
        f"{c.preemption_mode}, by {c.preemption_policy}")
    return [pool_id, "replay", c.num_blocks, c.block_size, mode,
            result.num_requests, result.num_steps, f"{result.sim_s:.1f}",
            _percent(result.peak_utilization), _percent(result.mean_utilization),
            _percent(result.hit_rate), result.num_preemptions, result.num_swap_outs,
            f"{result.wall_s:.2f}", f"{result.steps_per_s:,.0f}"]


def min_row(pool_id: str, found: MinBlocks) -> list[Any]:
    c = found.config
    return [pool_id, c.block_size, c.preemption_mode, c.num_blocks,
            f"{c.num_blocks * c.block_size:,}", found.num_probes, f"{found.wall_s:.1f}"]


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def payload(recording: Recording, results: dict[str, list[ReplayResult]],
            minimums: dict[str, list[MinBlocks]]) -> dict[str, Any]:
    pools = {}
    for pool_id, trace in recording.pools.items():
        pools[pool_id] = {
            "shape": asdict(trace.shape),
            "recorded": asdict(trace.recorded),
            "num_requests": len(trace.requests),
            "num_sequences": trace.num_sequences,
            "num_unfinished": trace.num_unfinished,
            "step_time": asdict(trace.step_time),
            "step_time_model": trace.step_time.describe(),
            "replays": [_result(r) for r in results.get(pool_id, [])],
            "min_blocks": [{"config": asdict(m.config), "num_probes": m.num_probes,
                            "wall_s": m.wall_s} for m in minimums.get(pool_id, [])],
        }
    return {"recording": recording.path, "token_ids": recording.token_ids,
            "warnings": list(recording.warnings), "pools": pools}


def _result(result: ReplayResult) -> dict[str, Any]:
    return {**asdict(result), "peak_utilization": result.peak_utilization,
            "mean_utilization": result.mean_utilization, "hit_rate": result.hit_rate,
            "steps_per_s": result.steps_per_s}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Whole or not at all: a temporary file beside it, renamed over it once written."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=2)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
