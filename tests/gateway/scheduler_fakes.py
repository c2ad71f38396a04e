"""In-memory stand-ins for the allocator and the executor, for scheduler unit tests.

FakePool follows the allocator's Step contract in its simplest form (no prefix cache):
commits, frees and aborts first; items in order; a known request short of blocks preempts
known requests from the tail (recompute); new requests are admitted from free space only, in
order, stopping at the first that does not fit, and never in a step that preempted.
FakeModel checks positions like the executor does and samples a token that depends on every
token of the sequence, so a wrong position or a lost token changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.step import (
    ExecuteCall,
    ExecuteResult,
    Grant,
    Preemption,
    Sampled,
    StepCall,
    StepOutcome,
    TableDelta,
)


@dataclass(slots=True)
class FakeRequest:
    tokens: list[int]
    num_computed: int
    table: list[int]


@dataclass(slots=True)
class FakePool:
    num_blocks: int
    block_size: int
    free: list[int] = field(default_factory=list)
    requests: dict[str, FakeRequest] = field(default_factory=dict)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _release(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        self.free.extend(reversed(request.table))

    def step(self, call: StepCall) -> StepOutcome:
        for commit in call.commits:
            assert commit.request_id in self.requests, f"commit for unknown {commit.request_id}"
        for request_id in (*call.free_request_ids, *call.abort_request_ids):
            self._release(request_id)
        grants: dict[str, Grant] = {}
        preempted: list[Preemption] = []
        deferred: set[str] = set()
        order = [i.request_id for i in call.items if not i.is_new]
        for item in call.items:
            if item.is_new:
                if preempted or deferred:
                    deferred.add(item.request_id)
                    continue
                assert item.request_id not in self.requests, "admitted twice"
                num = min(item.num_tokens, len(item.prompt_token_ids))
                need = self._blocks(num)
                if need > len(self.free):
                    deferred.add(item.request_id)
                    continue
                table = [self.free.pop(0) for _ in range(need)]
                self.requests[item.request_id] = FakeRequest(
                    list(item.prompt_token_ids), num, table
                )
                grants[item.request_id] = Grant(item.request_id, TableDelta(0, tuple(table)),
                                                0, num, 0, True)
                continue
            if any(p.request_id == item.request_id for p in preempted):
                continue
            request = self.requests[item.request_id]
            request.tokens.extend(item.append_token_ids)
            num = min(item.num_tokens, len(request.tokens) - request.num_computed)
            need = self._blocks(request.num_computed + num) - len(request.table)
            while need > len(self.free):
                victims = [r for r in order if r in self.requests and r != item.request_id]
                victim = victims[-1] if victims else item.request_id
                order.remove(victim)
                self._release(victim)
                self.num_preemptions += 1
                preempted.append(Preemption(victim, swapped=False))
                grants.pop(victim, None)
                if victim == item.request_id:
                    break
            if item.request_id not in self.requests:
                continue
            start = len(request.table)
            request.table.extend(self.free.pop(0) for _ in range(need))
            grants[item.request_id] = Grant(
                item.request_id,
                TableDelta(start, tuple(request.table[start:])) if need else None,
                0, num, request.num_computed, False,
            )
            request.num_computed += num
        return StepOutcome(grants=grants, preempted=tuple(preempted),
                           deferred_request_ids=frozenset(deferred),
                           num_free_blocks=len(self.free))


@dataclass(slots=True)
class FakeModel:
    vocab_size: int = 97
    held: dict[str, list[int]] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)

    def next_token(self, tokens: list[int]) -> int:
        acc = 7
        for t in tokens:
            acc = (acc * 31 + t) % 1_000_003
        return acc % self.vocab_size

    def execute(self, call: ExecuteCall) -> ExecuteResult:
        for request_id in call.release_request_ids:  # unknown ids are ignored (the contract)
            self.held.pop(request_id, None)
            self.tables.pop(request_id, None)
        sampled = []
        for seq in call.seqs:
            if seq.sampling is not None:
                assert seq.request_id not in self.held, f"{seq.request_id} created twice"
                self.held[seq.request_id] = []
                self.tables[seq.request_id] = []
            held = self.held[seq.request_id]
            assert seq.start_position == len(held), (
                f"{seq.request_id}: start {seq.start_position}, executor holds {len(held)}"
            )
            if seq.delta is not None:
                seq.delta.apply(self.tables[seq.request_id])
            held.extend(seq.token_ids)
            if seq.sample:
                sampled.append(Sampled(seq.request_id, self.next_token(held), 0.0))
        return ExecuteResult(tokens=tuple(sampled), compute_ms=0.0)

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(self.next_token(tokens))
        return tokens[len(prompt):]
