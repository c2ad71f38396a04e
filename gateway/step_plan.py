"""Planning a step: which sequences run next and how many tokens each computes, under the
budgets (`max_num_seqs`, `max_num_batched_tokens`). The first of the scheduler's calls in a
step (scheduler.py).

Priority is FCFS: running sequences first (one decode token each, or their next prefill
chunk), then swapped ones (swap-in), then waiting ones (prefill, chunked when the token budget
is short). Commits, frees and aborts queued in `pending` ride on the same allocator call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.batch import ScheduledStep
from gateway.request_state import SeqStatus, Sequence
from gateway.step import Commit, StepCall, StepItem

if TYPE_CHECKING:
    from gateway.scheduler import Scheduler


def plan_step(sched: Scheduler, in_flight: bool = False) -> ScheduledStep | None:
    """Choose the step's items under the budgets; None when there is nothing to send.

    `in_flight`: the previous step's batch is still executing (a pipelined step). Each of its
    sequences that samples decodes the token being sampled (a pending decode: the allocator
    needs the count, not the value), unless that token is its last by length; the others
    plan on top of what the batch computes. The values of the tokens pending decodes were
    granted in the previous step are known by now and go along as late tokens.

    NOTE: running decodes go first, then pending decodes, then running prefill chunks,
    swapped and new requests: decodes travel in the allocator's compact forms, which come
    before the other items. Under pressure, an old request still prefilling in chunks can
    therefore be preempted before a newer decoding one (vLLM V1 orders purely by arrival).
    """
    tokens_left = sched.budget.max_num_batched_tokens
    seqs_left = sched.budget.max_num_seqs
    decode_ids: list[str] = []
    decode_tokens: list[int] = []
    pending_ids: list[str] = []
    late: list[Sequence] = []
    items: list[StepItem] = []
    seqs: dict[str, Sequence] = {}
    for seq in [*sched.running, *sched.swapped]:
        known = seq.num_allocator_tokens  # tokens whose values the allocator holds
        if seq.allocator_pending and seq.known_to_allocator:
            late.append(seq)
            known += 1  # with this call's late token
        if seqs_left == 0 or tokens_left == 0:
            continue
        ahead = seq.num_in_flight
        if ahead and seq.samples_in_flight:
            if not _samples_its_last(seq):
                pending_ids.append(seq.seq_id)
                seqs[seq.seq_id] = seq
                tokens_left -= 1
                seqs_left -= 1
            continue
        num = min(seq.num_uncomputed_tokens - ahead, tokens_left)
        if num <= 0:
            continue
        if _is_decode(seq, num, known):
            decode_ids.append(seq.seq_id)
            decode_tokens.append(seq.last_token_id)
        else:
            append = tuple(seq.token_slice(known))
            items.append(StepItem(seq.seq_id, num, append_token_ids=append))
        seqs[seq.seq_id] = seq
        tokens_left -= num
        seqs_left -= 1
    # Swapped sequences are older than any waiting one: admit nothing new before them.
    for seq in sched.waiting if not sched.swapped else ():
        if seqs_left == 0 or tokens_left == 0:
            break
        num = min(seq.num_tokens, tokens_left)
        items.append(
            StepItem(
                seq.seq_id, num, prompt_token_ids=tuple(seq.token_ids),
                cache_salt=seq.request.cache_salt, is_new=True,
            )
        )
        seqs[seq.seq_id] = seq
        tokens_left -= num
        seqs_left -= 1
    pending = sched.pending
    has_items = bool(decode_ids or pending_ids or items)
    if not has_items and not pending.has_allocator_work():
        return None
    commit_previous = has_items and bool(pending.executed) and not pending.batch_rejected
    if not commit_previous:
        for request_id, num_computed in pending.executed.items():
            pending.commits.setdefault(request_id, num_computed)
    call = StepCall(
        commits=tuple(Commit(k, v) for k, v in pending.commits.items()),
        free_request_ids=tuple(pending.free_ids),
        abort_request_ids=tuple(pending.abort_ids),
        items=tuple(items),
        swap=sched.swap,
        commit_previous_step=commit_previous,
        decode_request_ids=tuple(decode_ids),
        decode_token_ids=tuple(decode_tokens),
        previous_step_in_flight=in_flight and has_items,
        pending_decode_request_ids=tuple(pending_ids),
        late_request_ids=tuple(s.seq_id for s in late) if has_items else (),
        late_token_ids=tuple(s.token_at(s.num_allocator_tokens) for s in late) if has_items else (),
    )
    executed = dict(pending.executed) if commit_previous else {}
    pending.executed.clear()
    if has_items:  # a Step: the allocator drops what it does not commit (a Free keeps it)
        pending.batch_rejected = False
    pending.commits.clear()
    pending.free_ids.clear()
    pending.abort_ids.clear()
    return ScheduledStep(call=call, seqs=seqs, executed=executed,
                         late=late if has_items else [])


def _samples_its_last(seq: Sequence) -> bool:
    """The token the batch in flight samples for `seq` is its last (max_tokens): nothing to
    plan. (A sequence that ends otherwise frees the slot it was granted.)"""
    return len(seq.output_token_ids) + 1 >= seq.request.sampling.max_tokens


def _is_decode(seq: Sequence, num: int, known: int) -> bool:
    """A running sequence computing one token, the one token the allocator has not seen
    (`known`: the tokens it will hold once this call's late token is in)."""
    return (
        num == 1 and seq.status is SeqStatus.RUNNING and not seq.is_prefill_parent
        and known + 1 == seq.num_tokens
    )
