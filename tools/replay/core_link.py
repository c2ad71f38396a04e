"""The allocator core's step result as the gateway's outcome, in process: what
allocator_svc/convert.py and gateway/clients/allocator_client.py do across the wire, without
the wire. (The call needs no conversion: both sides share common/step_records.py.)"""

from __future__ import annotations

from allocator_svc.core.step import StepResult
from common.step_records import PreemptionMode
from gateway.core.step import (
    Grant,
    Preemption,
    StepOutcome,
    TableDelta,
)


def outcome(result: StepResult, block_size: int) -> StepOutcome:
    appended = dict(zip(result.appended_request_ids, result.appended_block_ids, strict=True))
    grants = {}
    for g in result.grants:
        if (len(g.block_ids) == 1 and g.num_scheduled == 1 and not g.new_request
                and g.start_position == g.delta_start * block_size):
            appended[g.request_id] = g.block_ids[0]  # a grant that only appends a block
        else:
            grants[g.request_id] = Grant(g.request_id, TableDelta(g.delta_start,
                                                                  tuple(g.block_ids)),
                                         g.num_cached_tokens, g.num_scheduled,
                                         g.start_position)
    return StepOutcome(
        grants=grants,
        preempted=tuple(Preemption(p.request_id, p.mode is PreemptionMode.SWAP)
                        for p in result.preempted),
        deferred_request_ids=frozenset(result.deferred),
        copies=tuple(result.copies),
        swap_out=tuple(result.swap_out),
        swap_in=tuple(result.swap_in),
        appended=appended,
    )
