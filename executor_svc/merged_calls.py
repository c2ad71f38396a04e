"""Several callers' Execute calls as one forward pass, and each caller's answer out of it.

Gateways schedule onto an executor independently (each its own lease, sequences and step
ids), and a step is mostly fixed cost: the executor merges the calls waiting for it into one
forward (DESIGN.md, "One forward per executor per step").

Which calls merge (`calls_to_merge`): the oldest waiting call always; each later one unless it
names a request (a sequence or a release) or builds on a step (`previous_step_id`) that an
older waiting call also names, taken or not, or unless it would take the forward past
max_num_seqs or max_num_batched_tokens. So a caller's calls keep their order (its next call,
sent ahead, waits for the forward after its current one), and no call waits behind a younger
one for ever (it becomes the oldest).

Why merging is safe for the blocks: each call's releases, swaps and copies are applied in
turn, in queue order, before the one forward, and the allocator never gives one caller a
block another caller's step still reads or writes (prefix-cached blocks are shared, but
written only before they are cached: the commit rule). So the merged step does what the calls
one after another would, only the forwards are one.

What merging means for a caller: it gets its own rows (tokens in its own step order), its own
num_tokens, and the merged forward's timings; a call the plan refuses gets its own error and
changes nothing, while the other calls run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

from common.errors import ServiceError
from executor_svc.plan import PlannedSeq, StepPlan
from executor_svc.step import PromptLogprobs, SampledToken, StepRequest, StepResult, Timings


@dataclass(frozen=True, slots=True)
class CallShape:
    """What merging looks at in one waiting call."""

    step_id: int  # 0: unnumbered
    previous_step_id: int  # 0: builds on none
    request_ids: frozenset[str]  # its sequences and its releases
    num_seqs: int
    num_tokens: int

    @staticmethod
    def of(step: StepRequest, step_id: int = 0, previous_step_id: int = 0) -> CallShape:
        names = frozenset(chain((w.request_id for w in step.seqs), step.release_request_ids))
        return CallShape(step_id, previous_step_id, names, len(step.seqs),
                         sum(len(w.token_ids) for w in step.seqs))


def calls_to_merge(waiting: Sequence[CallShape], max_num_seqs: int,
                   max_num_batched_tokens: int) -> list[int]:
    """The indices (into `waiting`, oldest first) of the calls the next forward takes."""
    taken: list[int] = []
    named: set[str] = set()
    steps: set[int] = set()
    num_seqs = num_tokens = 0
    for index, call in enumerate(waiting):
        clash = not named.isdisjoint(call.request_ids) or call.previous_step_id in steps
        fits = (num_seqs + call.num_seqs <= max_num_seqs
                and num_tokens + call.num_tokens <= max_num_batched_tokens)
        if not taken or (fits and not clash):
            taken.append(index)
            num_seqs += call.num_seqs
            num_tokens += call.num_tokens
        named |= call.request_ids
        if call.step_id:
            steps.add(call.step_id)
    return taken


class MergedPlan:
    """Each call's plan (or why it was refused), in queue order; the forward's sequences are
    the plans' sequences, concatenated."""

    __slots__ = ("outcomes",)

    def __init__(self, outcomes: list[StepPlan | ServiceError]) -> None:
        self.outcomes = outcomes

    def plans(self) -> Iterator[StepPlan]:
        return (o for o in self.outcomes if isinstance(o, StepPlan))

    @property
    def seqs(self) -> tuple[PlannedSeq, ...]:
        return tuple(chain.from_iterable(plan.seqs for plan in self.plans()))

    def results(self, tokens: Sequence[SampledToken], timings: Timings,
                prompt_logprobs: Sequence[PromptLogprobs] = ()
                ) -> list[StepResult | ServiceError]:
        """Each call's rows of the forward's sampled `tokens` (one per sampling sequence, in
        the forward's order) and its requests' prompt logprobs, or its refusal."""
        results: list[StepResult | ServiceError] = []
        first = 0
        for outcome in self.outcomes:
            if isinstance(outcome, ServiceError):
                results.append(outcome)
                continue
            num_sampled = sum(1 for p in outcome.seqs if p.work.sample)
            mine = {p.work.request_id for p in outcome.seqs} if prompt_logprobs else set()
            results.append(StepResult(
                tokens=tuple(tokens[first:first + num_sampled]), timings=timings,
                num_tokens=sum(len(p.token_ids) for p in outcome.seqs),
                prompt_logprobs=tuple(p for p in prompt_logprobs if p.request_id in mine)))
            first += num_sampled
        assert first == len(tokens), f"{len(tokens)} tokens sampled for {first} rows"
        return results


def only(results: list[StepResult | ServiceError]) -> StepResult:
    """A lone call's result, its refusal raised."""
    (result,) = results
    if isinstance(result, ServiceError):
        raise result
    return result
