"""Request log lines (allocator_svc.request_log): at INFO only the rare lifecycle events are
logged, each naming its request; the per-request DEBUG lines cost nothing unless enabled."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from allocator_svc import request_log
from common.step_records import StepCall
from tests.allocator.conftest import append_columns, as_call_parts, decode, make_harness, new

NS = "0a1b2c3d/"


@pytest.fixture
def at_level() -> Iterator[list[dict[str, object]]]:
    """Logs filtered at INFO, as `--log-level info` configures them, captured."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.reset_defaults()


def test_request_log_at_info_keeps_lifecycle_events_only(at_level) -> None:
    # 2 blocks of 4: a and b take one each; a's 5th token preempts b (INFO); c is deferred,
    # a admitted and freed (DEBUG: not logged at INFO).
    harness = make_harness(num_blocks=2, block_size=4)
    harness.step([new(NS + "a", [1, 2, 3, 4]), new(NS + "b", [5, 6, 7, 8])])
    items, appends = as_call_parts([decode(NS + "a", 9), decode(NS + "b", 9), new(NS + "c", [1])])
    call = StepCall(items, **append_columns(appends))
    result = harness.allocator.step("pool-a", harness.pool.epoch, None, call)
    request_log.step_applied("pool-a", call, result)
    assert not request_log.debug_enabled()
    assert [(e["event"], e["log_level"], e["request_id"], e["seq_id"]) for e in at_level] == [
        ("request_preempted", "info", "b", NS + "b")]
