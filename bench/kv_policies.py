"""KV reservation policies compared by the utilisation benchmark.

Contiguous policies (what pre-paging systems did) reserve one contiguous run of slots per
request at admission, first fit: `max` (the model's maximum length), `pow2` (a power of two
above the true length) and `exact` (the true length, an oracle). `paged` is the real allocator
core: blocks on demand, preemption (recompute) when the pool runs dry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.step_records import StepCall, StepItem


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_len: int
    output_len: int
    generated: int = 0  # output tokens sampled so far
    kv: int = 0  # tokens whose KV the cache holds
    offset: int | None = None  # contiguous policies: start of its reservation


@dataclass
class StepOutcome:
    admitted: list[SimRequest] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)


class ContiguousPolicy:
    """First-fit contiguous reservation over `num_slots` slots."""

    def __init__(self, name: str, num_slots: int, max_len: int) -> None:
        self.name = name
        self.max_len = max_len
        self.gaps: list[tuple[int, int]] = [(0, num_slots)]  # sorted (start, length)
        self.reserved = 0
        self.sizes: dict[str, int] = {}

    def size(self, request: SimRequest) -> int:
        total = request.prompt_len + request.output_len
        if self.name == "max":
            return self.max_len
        if self.name == "pow2":
            return 1 << (total - 1).bit_length()
        return total

    def step(self, running: list[SimRequest], waiting: list[SimRequest]) -> StepOutcome:
        outcome = StepOutcome()
        for request in waiting:  # FCFS: stop at the first that does not fit
            size = self.size(request)
            for index, (start, length) in enumerate(self.gaps):
                if length >= size:
                    self.gaps[index] = (start + size, length - size)
                    request.offset = start
                    self.sizes[request.request_id] = size
                    self.reserved += size
                    outcome.admitted.append(request)
                    break
            else:
                break
        self.gaps = [g for g in self.gaps if g[1] > 0]
        return outcome

    def release(self, request: SimRequest) -> None:
        size = self.sizes.pop(request.request_id)
        assert request.offset is not None
        self.reserved -= size
        self.gaps.append((request.offset, size))
        self.gaps.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self.gaps:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.gaps = merged

    def reserved_slots(self) -> int:
        return self.reserved


class PagedPolicy:
    """The real allocator core at one block size; recompute preemption."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        self.name = f"paged-{block_size}"
        self.block_size = block_size
        self.allocator = Allocator(Limits(max_batch_items=1 << 16))
        self.pool, _ = self.allocator.register_pool(
            PoolConfig("sim", num_slots // block_size, block_size, 0, "sim", "sim", False)
        )
        self.num_preemptions = 0

    def step(self, running: list[SimRequest], waiting: list[SimRequest]) -> StepOutcome:
        decode_ids = [r.request_id for r in running]  # one more token each, its value 0
        items: list[StepItem] = []
        by_id = {r.request_id: r for r in (*running, *waiting)}
        for request in waiting:
            # A readmitted (preempted) request recomputes its prompt and what it generated.
            known = request.prompt_len + request.generated
            items.append(StepItem(request.request_id, known, [0] * known))
        if not items and not decode_ids:
            return StepOutcome()
        result = self.allocator.step(
            "sim", self.pool.epoch, None,
            StepCall(items, decode_request_ids=decode_ids, append_request_ids=decode_ids,
                append_token_ids=[0] * len(decode_ids)))
        outcome = StepOutcome()
        deferred = set(result.deferred)
        outcome.admitted = [r for r in waiting if r.request_id not in deferred]
        outcome.preempted = [by_id[p.request_id] for p in result.preempted]
        self.num_preemptions += len(outcome.preempted)
        return outcome

    def release(self, request: SimRequest) -> None:
        self.allocator.free("sim", self.pool.epoch, [], [request.request_id])

    def reserved_slots(self) -> int:
        return (self.pool.config.num_blocks - self.pool.blocks.num_free) * self.block_size
