"""Hand-off parking: running sequences set aside, computed and idle, for engine/hand_off.py
to move to another executor.

While its `move_quota` lasts (a prefill executor's engine with a decode executor to hand to,
one draining, or one rebalancing), planning parks each running sequence once it is computed
and idle (its prompt done, its last token sampled and landed) instead of scheduling its next
token; the engine moves parked sequences to another engine (`SequenceQueues.detach`
here, `adopt` there) or gives them back (`unpark`), core/queues.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.request_state import SeqStatus, Sequence


@dataclass(slots=True)
class Parking:
    # Computed and idle, held at the allocator and executor, waiting for their hand-off.
    parked: list[Sequence] = field(default_factory=list)
    move_quota: int = 0  # how many more to park (0: none)
    # Parked since the engine last asked (take_newly_parked): their hand-offs start.
    newly_parked: list[Sequence] = field(default_factory=list)
    # The LoRA adapters (name, digest) some target serves: a sequence of another stays.
    adapters: frozenset[tuple[str, str]] = frozenset()

    def park_leavers(self, running: list[Sequence]) -> tuple[list[Sequence], set[Sequence]]:
        """Up to the quota of running sequences to move, the newest first: those computed and
        idle are parked now, those whose next token is being sampled once it lands (no
        decode is planned on top of them). Returns `running` without the parked, and the
        latter."""
        idle: list[Sequence] = []
        sampling: set[Sequence] = set()
        for seq in reversed(running):
            if len(idle) + len(sampling) == self.move_quota:
                break
            lora = seq.request.lora
            if not _movable(seq) or (lora is not None
                                     and (lora.name, lora.digest) not in self.adapters):
                continue
            if seq.num_in_flight:
                if seq.samples_in_flight:
                    sampling.add(seq)
            elif not seq.num_placeholders and seq.num_uncomputed_tokens == 1:
                idle.append(seq)
        if not idle:
            return running, sampling
        for seq in idle:
            seq.status = SeqStatus.PARKED
        self.parked.extend(idle)
        self.newly_parked.extend(idle)
        parked = set(idle)
        return [s for s in running if s not in parked], sampling

    def take_newly_parked(self) -> list[Sequence]:
        parked, self.newly_parked = self.newly_parked, []
        return parked

    def leave(self, seq: Sequence) -> bool:
        """It is parked no more; whether it was."""
        if seq not in self.parked:
            return False
        self.parked.remove(seq)
        return True

    def clear(self) -> None:
        self.parked.clear()
        self.newly_parked.clear()

    def drop_finished(self) -> None:
        if any(s.is_finished for s in self.parked):
            self.parked = [s for s in self.parked if not s.is_finished]


def _movable(seq: Sequence) -> bool:
    """A sequence that may be handed off once idle: it has sampled (a prompt is computed where
    it arrived); not a beam (a search's beams stay in one pool), nor one whose move failed,
    nor one whose accepted drafts its allocator has yet to count (the next Step tells it)."""
    return (
        not seq.stays and not seq.is_beam and not seq.is_prefill_parent
        and seq.accepted_drafts is None
        and (bool(seq.output_token_ids) or seq.samples_in_flight)
    )
