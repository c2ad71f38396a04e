"""The engine's one timing system: summaries over a window, and one JSON line per step."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from gateway.engine.step_stats import StepRecord, StepStats


def _record(period: float, execute: float = 9.0) -> StepRecord:
    return StepRecord(period_ms=period, schedule_ms=0.2, allocator_ms=0.5, execute_ms=execute,
                      forward_ms=7.0, sample_ms=1.0, executor_ms=8.5, num_seqs=4,
                      num_tokens=4, ahead=True)


def test_each_step_is_one_json_line_with_its_pool(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    stats = StepStats(window=0, log_path=str(path))
    records = [_record(10.0), _record(12.0)]
    for record in records:
        stats.record(record, "pool-a")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"pool_id": "pool-a", **asdict(r)} for r in records]


def test_the_summary_takes_the_control_plane_as_the_period_less_the_model() -> None:
    # Control plane: the period less forward + sample (8 ms), or less the Execute round trip
    # when that is shorter (a call that waited for nothing).
    stats = StepStats(window=3)
    for period, execute in ((10.0, 9.0), (11.0, 9.0), (10.0, 6.0)):
        stats.record(_record(period, execute))
    assert stats.should_report()
    summary = stats.summary()
    assert summary["num_steps"] == 3 and summary["p50_step_ms"] == 10.0
    assert summary["p50_control_ms"] == 3.0  # medians of 2, 3 and 4
    assert summary["p50_allocator_ms"] == 0.5 and summary["mean_seqs"] == 4.0
