"""Beam search in an engine: once every running beam of a search has landed its candidates,
its next step is selected (core/beam_search.py) and applied to the pool.

    select     -> which beams continue with which token, which fork, which are pruned
    Fork       -> a beam continued more than once gets children at the allocator, which
                  share all its blocks; the partial last one is copied on their first write
                  (the copy rides on the Step that grants it, and on that Execute)
    finish     -> pruned beams are freed (Free with the next Step, Release with the next
                  Execute)
    append     -> each running beam's chosen token: its next decode sends it (never the
                  executor's own pick, so beams run one batch deep: scheduler.py skips them
                  while their batch is in flight)
    done       -> every beam freed; the n best hypotheses are emitted, one delta each

A search whose beam failed, or that was cancelled, is over: its other beams are failed or
aborted by whoever ended the first, and nothing is selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from common.errors import Unavailable
from gateway.clients.call_failures import CallFailed
from gateway.core.beam_search import BeamSearch, Hypothesis, Selection
from gateway.core.request_state import (
    CompletionDelta,
    FinishReason,
    Request,
    SeqStatus,
    Sequence,
    Usage,
)
from gateway.core.seq_ids import beam_seq_id, num_beam_slots, wire_id
from gateway.engine.side_calls import SideCalls
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)


class BeamSteps(SideCalls):
    """Beam searches' steps (a base class of engine/loop.py's Engine, below its landing)."""

    __slots__ = ()

    async def advance_beams(self, landed: list[Sequence]) -> None:
        """Beams whose batch landed: each search whose running beams all have candidates takes
        its next step."""
        requests = list(dict.fromkeys(seq.request for seq in landed))
        for request in requests:
            search = request.beam_search
            assert search is not None, f"{request.request_id}: a beam without a search"
            beams = [beam.handle for beam in search.running]
            if search.done or request.cancelled or any(b.is_finished for b in beams):
                continue
            if any(b.waits_for_room and b.status is not SeqStatus.RUNNING for b in beams):
                self.scheduler.set_aside_landed_beams(request)  # no blocks held meanwhile
                continue
            if any(b.beam_candidates is None for b in beams):
                continue  # some are still computing (budgets, preemption)
            candidates = [b.beam_candidates or () for b in beams]
            for beam in beams:
                beam.beam_candidates = None
            selection = search.select(candidates, _Namer(self, {b.seq_id for b in beams}))
            await self._apply_selection(request, search, selection)

    async def _apply_selection(self, request: Request, search: BeamSearch[Sequence],
                               selection: Selection[Sequence]) -> None:
        scheduler = self.scheduler
        for seq in selection.pruned:
            scheduler.finish(seq)
        if selection.done:
            self._emit_results(request, search.results())
            return
        for parent, children in selection.forks:
            if not await self._fork_beams(parent, children):
                return
        for seq, token in selection.appends:
            seq.output_token_ids.append(token)

    async def _fork_beams(self, parent: Sequence, children: list[Sequence]) -> bool:
        """Children that share the parent's blocks, at the allocator and in the scheduler; on
        failure the search fails (its running beams)."""
        child_ids = [c.seq_id for c in children]
        try:
            with self.orphans.until_tracked(child_ids):
                tables = await self.link.fork(parent.seq_id, child_ids, parent.request.request_id)
                self.scheduler.fork(parent, children, tables, keep_parent=True)
        except CallFailed as exc:
            log.warning("beam_fork_failed", code=exc.status, details=exc.details)
            self._fail_search(parent.request, Unavailable(f"beam fork failed ({exc.status})"))
            return False
        return True

    def _fail_search(self, request: Request, error: Unavailable) -> None:
        search = request.beam_search
        assert search is not None
        for beam in search.running:
            if beam.handle.status is not SeqStatus.FINISHED:
                self.fail(beam.handle, error)

    def _emit_results(self, request: Request, hypotheses: list[Hypothesis]) -> None:
        """The n best hypotheses, one final delta each, index 0 the best (their text is made
        on the API's side, text/output.py)."""
        for index, hypothesis in enumerate(hypotheses):
            tokens = hypothesis.token_ids
            self.outbox.append((request, CompletionDelta(
                index=index, token_ids=tokens,
                finish_reason=FinishReason.STOP if hypothesis.stopped else FinishReason.LENGTH,
                usage=Usage(prompt_tokens=len(request.prompt_token_ids),
                            completion_tokens=len(tokens),
                            cached_prompt_tokens=request.num_cached_tokens or 0),
            )))
        self.deliver()
        assert request.beam_search is not None
        log.info("beam_search_finished", num_hypotheses=len(hypotheses),
                 best_score=hypotheses[0].score if hypotheses else None,
                 num_steps=request.beam_search.num_generated)


@dataclass(slots=True)
class _Namer:
    """Names the beams one selection forks: the lowest free slot (seq_ids.py), not a running
    beam's, nor one named already, nor one whose Free, Abort or Release has not gone out."""

    engine: EngineState
    taken: set[str]

    def __call__(self, parent: Sequence) -> Sequence:
        request = parent.request
        assert request.sampling.beam is not None, f"{parent.seq_id} is not a beam"
        pending = self.engine.scheduler.pending
        busy = {*pending.free_request_ids, *pending.abort_request_ids, *pending.release_ids,
                *self.engine.orphans.ids}
        rid = wire_id(request.id_namespace, request.request_id)
        for slot in range(num_beam_slots(request.sampling.beam.beam_width)):
            seq_id = beam_seq_id(rid, slot)
            if seq_id not in self.taken and seq_id not in busy:
                self.taken.add(seq_id)
                return Sequence(seq_id=seq_id, request=request, index=slot, is_beam=True)
        # beam_width run, at most beam_width - 1 are forked, and the ids pruned in the step
        # before went out with the Step and the Execute that computed these beams.
        raise AssertionError(f"{request.request_id}: no free beam id")
