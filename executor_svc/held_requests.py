"""The requests an executor holds between steps, shared by the real runner (runner.py) and
the simulated one (simulated/runner.py): release, idle release, and recording what a step
computed. Imports no torch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog

from common.errors import ServiceError, Unimplemented
from common.executor_description import LoraAdapterInfo
from executor_svc.merged_calls import MergedPlan
from executor_svc.plan import (
    Limits,
    PlannedSeq,
    RequestState,
    StepPlan,
    idle_request_ids,
    plan_step,
)
from executor_svc.step import BlockCopy, SampledToken, SequenceWork, StepRequest

log = structlog.get_logger(__name__)


class BlockOps(Protocol):
    """A step's block moves, in the device KV cache or the simulated one."""

    def swap_out(self, copies: tuple[BlockCopy, ...]) -> None: ...

    def swap_in(self, copies: tuple[BlockCopy, ...]) -> None: ...

    def copy_blocks(self, copies: tuple[BlockCopy, ...]) -> None: ...


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Drafts accepted: each must equal the token sampled after the row before it; the first
    that does not ends them (targets[i] is the token sampled after draft i's predecessor)."""
    count = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        count += 1
    return count


class HeldRequests:
    limits: Limits  # set by the runner

    def __init__(self, idle_release_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requests: dict[str, RequestState] = {}
        # A caller that dies (a gateway killed) never releases its requests: a request no
        # step has used for `idle_release_s` is dropped (0: never). Checked at most every
        # tenth of that, from the steps themselves.
        self.idle_release_s = idle_release_s
        self.clock = clock
        self.next_idle_check = clock() + idle_release_s / 10

    def release(self, request_ids: tuple[str, ...]) -> int:
        """Drop the requests' state; unknown ids are ignored. Returns how many were held."""
        return sum(self.requests.pop(rid, None) is not None for rid in request_ids)

    def release_idle(self, steps: Sequence[StepRequest]) -> int:
        """Drop the requests no step has used for idle_release_s, never one that `steps`
        name (they are alive); returns how many."""
        now = self.clock()
        if not self.idle_release_s or now < self.next_idle_check:
            return 0
        self.next_idle_check = now + self.idle_release_s / 10
        idle = idle_request_ids(self.requests, steps, now, self.idle_release_s)
        if idle:
            log.warning("idle_requests_released", num_requests=len(idle),
                        idle_s=self.idle_release_s)
        return self.release(idle)

    def prepare(self, steps: Sequence[StepRequest], blocks: BlockOps) -> MergedPlan:
        """Each call planned, then its releases, swaps and copies applied, one call after
        another in queue order (merged_calls.py says why that is safe); a refused call
        changes nothing and the others go on. Before planning, the idle requests go: the
        plans hold the states they looked up."""
        self.release_idle(steps)
        outcomes: list[StepPlan | ServiceError] = []
        for step in steps:
            try:
                plan = plan_step(step, self.requests, self.limits)
                for planned in plan.seqs:
                    self.check_constraint(planned)
                    if planned.work.lora_adapter:
                        self.check_adapter(planned.work)
            except ServiceError as refused:
                outcomes.append(refused)
                continue
            self.release(plan.release_request_ids)
            blocks.swap_out(step.swap_out)
            blocks.swap_in(step.swap_in)
            blocks.copy_blocks(step.copies)
            outcomes.append(plan)
        return MergedPlan(outcomes)

    def check_constraint(self, planned: PlannedSeq) -> None:
        """A new request's structured output; this executor applies none (the real runner
        does: grammar.py)."""
        sampling = planned.work.sampling
        if sampling is not None and sampling.structured_output is not None:
            raise Unimplemented(
                f"request {planned.work.request_id!r}: this executor does not apply "
                "sampling.structured_output (Describe's structured_output is false)")

    def check_adapter(self, work: SequenceWork) -> None:
        """A new request's LoRA adapter; this executor serves none (the real runner may:
        lora.py)."""
        raise Unimplemented(f"request {work.request_id!r}: this executor serves no LoRA "
                            "adapters (Describe's max_loras is 0)")

    def read_lora_adapter(self, name: str, path: str) -> Any:
        """A PEFT directory read and checked (any thread); `install_lora_adapter` puts it in
        a slot (the compute thread)."""
        raise Unimplemented("this executor serves no LoRA adapters (Describe's max_loras is 0)")

    def install_lora_adapter(self, adapter: Any) -> LoraAdapterInfo:
        raise Unimplemented("this executor serves no LoRA adapters (Describe's max_loras is 0)")

    def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Read and install in one go (at start, and in tests)."""
        return self.install_lora_adapter(self.read_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        raise Unimplemented("this executor serves no LoRA adapters (Describe's max_loras is 0)")

    def new_state(self, work: SequenceWork) -> RequestState:
        """A new request's state (its first step carries its sampling)."""
        assert work.sampling is not None, "plan_step admits new requests with sampling"
        return RequestState(request_id=work.request_id, sampling=work.sampling,
                            generator=None, block_table=[], num_tokens=0,
                            prompt_token_ids=work.prompt_token_ids or None,
                            lora_adapter=work.lora_adapter)

    def verified(self, sampled: SampledToken, num_drafts: int, accepted: int, token_id: int,
                 logprob: float) -> SampledToken:
        """A sequence's drafts verified: it holds its known token and the `accepted` drafts
        (the rejected ones' slots are written again by later steps), and `token_id` follows."""
        state = self.requests[sampled.request_id]
        state.num_tokens -= num_drafts - accepted
        state.sampled_token = token_id
        return SampledToken(sampled.request_id, token_id, logprob, (), accepted)

    def commit(self, seqs: tuple[PlannedSeq, ...]) -> None:
        """The step computed these: new requests held, tables and counts as planned."""
        now = self.clock()
        for planned in seqs:
            work = planned.work
            state = self.requests.get(work.request_id)
            if planned.is_new:
                state = self.requests[work.request_id] = self.new_state(work)
            assert state is not None, f"planned request {work.request_id} vanished"
            state.block_table = list(planned.block_table)
            state.num_tokens = work.start_position + len(planned.token_ids)
            if state.processor is not None:
                state.processor.append(planned.token_ids, work.start_position, work.sample)
            state.sampled_token = None  # used, or overtaken by these tokens
            state.last_used = now
