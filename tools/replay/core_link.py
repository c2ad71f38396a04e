"""The gateway's step records to the allocator core's and back, in process: what
gateway/clients/allocator_client.py and allocator_svc/convert.py do across the wire, without
the wire."""

from __future__ import annotations

from allocator_svc.core.step import (
    Appends,
    PreemptionMode,
    StepResult,
)
from allocator_svc.core.step import StepCall as CoreStepCall
from gateway.core.step import (
    Grant,
    Preemption,
    StepCall,
    StepOutcome,
    TableDelta,
)


def core_call(pool_id: str, epoch: int, call: StepCall) -> CoreStepCall:
    appends = None
    if call.append_request_ids:
        appends = Appends(list(call.append_request_ids), list(call.append_token_ids))
    return CoreStepCall(
        pool_id, epoch, None,
        list(call.items),
        PreemptionMode.SWAP if call.swap else PreemptionMode.RECOMPUTE,
        list(call.commits),  # (one Commit record on both sides: common/step_records.py)
        list(call.free_request_ids), list(call.abort_request_ids),
        appends, list(call.decode_request_ids), call.step_id, call.commit_through_step_id,
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
