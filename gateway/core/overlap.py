"""Landing a batch, and depth 2: a batch planned on top of the one executing.

At depth 2 (engine/loop.py) step k+1 is planned while batch k executes (`launch` marks what
it computes: `Sequence.num_in_flight`, `samples_in_flight`), so the plan builds on top of
it: a sequence that batch k samples for decodes that token by count (scheduler.py). If
Step k+1 returns before batch k, batch k is `advance`d: its computed counts as if it had
returned, a placeholder counted in each sequence's tokens for the one it samples
(`num_placeholders`), so that batch k+1 is built on top of it (a row reaching a placeholder
goes with use_sampled_token, execute_call.py); once batch k returns, `fill` puts the values
in. At depth 1, `apply_result` does both at once. A batch that failed or is abandoned is
`land`ed: its counts and placeholders are taken out.

One base class of the scheduler, as vLLM's AsyncScheduler is one subclass of its scheduler:
the counts above are the whole of what depth 2 adds.
"""

from __future__ import annotations

from gateway.core.batch import Batch, Pending
from gateway.core.request_state import SeqStatus, Sequence, TokenLogprob
from gateway.core.step import ExecuteResult, SeqWork


class BatchLanding:
    """The scheduler's landing of its batches (its base class: the scheduler's fields hold
    the state)."""

    pending: Pending
    num_advanced: int  # batches advanced and not landed: their placeholders are out
    num_accepted_tokens: int  # draft tokens the executor accepted (speculative decoding)

    def apply_result(self, batch: Batch, result: ExecuteResult) -> list[tuple[Sequence, int]]:
        """Advance computed counts; return the sampled (sequence, token) pairs: the compact
        decodes first (column order), then the other sequences in schedule order."""
        if batch.stand_ins is None:
            self.advance(batch)
        return self.fill(batch, result)

    def advance(self, batch: Batch) -> None:
        """The batch's computed counts, as if it had returned, with a placeholder for each
        token it samples (`fill` puts the values in). This also lands it: the next batch is
        built on top of it. A sequence finished while it executed is left alone."""
        stand_ins: list[tuple[Sequence, int]] = []
        num_decodes, works = batch.num_decodes, batch.call.seqs
        for row, (seq, num) in enumerate(batch.scheduled):
            seq.num_in_flight = 0
            seq.samples_in_flight = False
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed_tokens += num
            if row < num_decodes or works[row - num_decodes].sample:
                assert not seq.num_placeholders, f"{seq.seq_id}: a second placeholder"
                seq.num_placeholders = 1
                stand_ins.append((seq, row))
        batch.stand_ins = stand_ins
        self.num_advanced += 1

    def fill(self, batch: Batch, result: ExecuteResult) -> list[tuple[Sequence, int]]:
        """The sampled values in place of the advanced batch's placeholders; the (sequence,
        token) pairs in batch order, but for sequences that finished since."""
        assert batch.stand_ins is not None, "fill before advance"
        self.num_advanced -= 1
        decoded, num_decodes = result.decode_token_ids, batch.num_decodes
        tokens = {t.request_id: t.token_id for t in result.tokens} if result.tokens else {}
        works = batch.call.seqs
        accepted: dict[str, int] | None = None  # drafts accepted, by sequence (when any)
        if result.prompt_logprobs:
            _record_prompt_logprobs(batch, result)
        # It executed: the allocator may commit what its Step (and every one before) granted.
        self.pending.executed_through = max(self.pending.executed_through, batch.step_id)
        sampled: list[tuple[Sequence, int]] = []
        for seq, row in batch.stand_ins:
            token = decoded[row] if row < num_decodes else tokens[seq.seq_id]
            seq.num_placeholders = 0
            if seq.is_beam:  # its search picks the token (engine/beams.py)
                seq.beam_candidates = logprob(result, row, num_decodes, seq.seq_id, token).top
                if seq.status is not SeqStatus.FINISHED:
                    sampled.append((seq, token))
                continue
            if row >= num_decodes and works[row - num_decodes].num_draft_tokens:
                if accepted is None:
                    accepted = {t.request_id: t.num_accepted for t in result.tokens}
                self._land_drafts(seq, works[row - num_decodes], accepted[seq.seq_id], token,
                                  sampled)
                continue
            seq.output_token_ids.append(token)
            if seq.status is not SeqStatus.FINISHED:
                sampled.append((seq, token))
                if seq.request.sampling.logprobs is not None:
                    seq.last_logprob = logprob(result, row, num_decodes, seq.seq_id, token)
        return sampled

    def _land_drafts(self, seq: Sequence, work: SeqWork, accepted: int, token: int,
                     sampled: list[tuple[Sequence, int]]) -> None:
        """A verified row: the accepted drafts, then the executor's token, land together.
        Their KV is computed (the allocator is told with the next Step); each is emitted in
        turn, and the first that ends the sequence drops the rest (finish_rules.py)."""
        landed = [*work.token_ids[len(work.token_ids) - work.num_draft_tokens:][:accepted],
                  token]
        seq.output_token_ids.extend(landed)
        seq.num_computed_tokens += accepted
        seq.accepted_drafts = accepted
        self.num_accepted_tokens += accepted
        if seq.status is not SeqStatus.FINISHED:
            seq.num_unemitted = len(landed) - 1
            sampled.extend((seq, t) for t in landed)

    def launch(self, batch: Batch) -> None:
        """The batch is executing: the next step plans on top of it (depth 2)."""
        for seq, num in batch.scheduled:
            seq.num_in_flight = num
            seq.samples_in_flight = (
                not seq.is_prefill_parent and seq.num_computed_tokens + num == seq.num_tokens
            )

    def land(self, batch: Batch) -> None:
        """The batch failed or is abandoned: it is no longer executing, and an advanced one's
        placeholders are taken out (its sequences are failed, recomputed or evicted next, so
        its counts do not matter)."""
        self.pending.failed_through = max(self.pending.failed_through, batch.step_id)
        if batch.stand_ins is None:
            for seq, _ in batch.scheduled:
                seq.num_in_flight = 0
                seq.samples_in_flight = False
            return
        for seq, _ in batch.stand_ins:
            assert seq.num_placeholders == 1, f"{seq.seq_id}: its placeholder is gone"
            seq.num_placeholders = 0
        batch.stand_ins = None  # (landing it again is harmless)
        self.num_advanced -= 1


def _record_prompt_logprobs(batch: Batch, result: ExecuteResult) -> None:
    """The prompt logprobs a batch's rows computed, onto their requests."""
    by_id = {seq.seq_id: seq for seq, _ in batch.scheduled}
    for run in result.prompt_logprobs:
        seq = by_id.get(run.request_id)
        if seq is not None:
            seq.request.record_prompt_logprobs(run.first_position, run.logprobs, run.ranks,
                                               run.top_logprobs)


def logprob(result: ExecuteResult, row: int, num_decodes: int, seq_id: str, token: int
             ) -> TokenLogprob:
    """The executor's logprobs for a landed token (a compact decode's by column)."""
    if row < num_decodes:
        top = result.decode_top_logprobs[row] if result.decode_top_logprobs else ()
        return TokenLogprob(token, result.decode_logprobs[row], top)
    sampled = next(t for t in result.tokens if t.request_id == seq_id)
    return TokenLogprob(token, sampled.logprob, sampled.top_logprobs)
