"""Stateful property test of overlapped steps (depth 2) against a simple reference model.

The model plays an overlapping gateway and its executor. Each step sends the allocator the
next Step while the previous batch is still "executing": decodes (by count) for the requests
that batch samples, the values of tokens sampled before (appends, some held back at random
for requests it does not decode), frees, new prompts, swapped requests coming back. Only
then does that batch execute: it writes a shadow KV cache (each slot remembers the salt,
position and token that wrote it) through the tables it was granted, even for requests the
Step just freed or preempted, as a real executor would.

What must hold, checked against the shadow cache rather than the allocator's own state:
- a prefix hit, read at the moment the Step returns (before the batch in flight has written
  anything), holds exactly the new request's tokens: nothing is cached before its KV is
  written (the commit rule under pipelining);
- every batch reads back its own tokens through its table before it writes (its swap and
  copy-on-write copies run first, when it executes, not when its Step returns);
- a batch may fail: nothing of it is applied, its requests are aborted with the next Step,
  and none of its blocks is ever served as a prefix hit, although later Steps commit through
  its step id (explicit step ids: "every step up to N executed", sent or not at random);
- the allocator's invariants hold after every step, its token values and counts are the
  model's, every block it caches holds the tokens that wrote it, and freeing everything
  returns every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from no_leak import free_all_and_check_no_leak

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.step_records import PreemptionMode, StepCall, StepItem
from tests.budget import examples

BLOCK_SIZE = 2
NUM_BLOCKS = 8
NUM_CPU_BLOCKS = 6
SALTS = ("", "tenant")

Slot = tuple[str, int, int]  # (salt, position, token) that wrote the slot


@dataclass
class Mirror:
    """What the gateway knows of one request."""

    salt: str
    tokens: list[int]  # every known value: the prompt, then sampled tokens
    known_to_allocator: int = 0  # values the allocator holds
    computed: int = 0  # positions granted by the allocator (executed or in flight)
    table: list[int] = field(default_factory=list)
    swapped: bool = False


@dataclass
class Work:
    """One request's part of the batch in flight, with the table it was granted."""

    request_id: str
    mirror: Mirror
    start: int
    num: int
    sample: bool
    table: list[int]


def _sample(tokens: list[int], position: int) -> int:
    """A deterministic 'model': equal prefixes continue equally, so prefixes get shared."""
    return (sum(tokens[-2:]) + position) % 3


class OverlapMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = Allocator(Limits(max_batch_items=64, event_capacity=1 << 16))
        self.pool, _ = self.allocator.register_pool(
            PoolConfig("p", NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, "fp", "i", True)
        )
        self.lease_id = self.allocator.create_lease(600.0).lease_id
        self.gpu: dict[int, list[Slot | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.cpu: dict[int, list[Slot | None]] = {
            b: [None] * BLOCK_SIZE for b in range(NUM_CPU_BLOCKS)
        }
        self.requests: dict[str, Mirror] = {}
        self.in_flight: list[Work] = []
        # The in-flight batch's copies (swap out, swap in, copy-on-write) and the requests
        # its Step swapped out; the requests of the batch that failed, and whether it did.
        self.in_flight_ops: tuple[list, list, list] = ([], [], [])
        self.in_flight_swapped: set[str] = set()
        self.failed: set[str] = set()
        self.last_batch_failed = False
        self.step_id = 0  # the last Step's number
        self.in_flight_step = 0  # the number of the Step whose batch is in flight
        self.executed_through = 0  # the newest step whose batch executed
        self.next_id = 0
        self.num_unknown_granted = 0  # decodes granted before their value was known

    def _read(self, table: list[int], upto: int) -> list[Slot | None]:
        return [self.gpu[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(upto)]

    @staticmethod
    def _expect(mirror: Mirror, upto: int) -> list[Slot]:
        return [(mirror.salt, p, mirror.tokens[p]) for p in range(upto)]

    @rule(
        prompts=st.lists(
            st.tuples(
                st.lists(st.integers(0, 2), min_size=1, max_size=7),
                st.sampled_from(SALTS),
                st.integers(1, 7),
            ),
            max_size=2,
        ),
        data=st.data(),
        swap=st.booleans(),
        confirm=st.booleans(),
        chunk=st.integers(1, 4),
    )
    def step(self, prompts, data, swap, confirm, chunk) -> None:
        # 1. What the gateway sends while the batch in flight executes. The requests of a
        # batch that failed are aborted; the steps executed so far are confirmed (or not).
        abort_ids = sorted(self.failed & set(self.requests))  # (not freed by a preemption)
        for request_id in abort_ids:
            del self.requests[request_id]
        self.failed.clear()
        sampling_now = {w.request_id for w in self.in_flight if w.sample}
        alive = sorted(self.requests)
        free_ids = data.draw(st.lists(st.sampled_from(alive), unique=True), "free") if alive else []
        append_ids, append_tokens, sent = [], [], {}
        decode_ids, items = [], []
        for request_id in alive:
            mirror = self.requests[request_id]
            values = mirror.tokens[mirror.known_to_allocator:]
            scheduled = request_id not in free_ids and data.draw(st.booleans(), "schedule")
            decodes = scheduled and request_id in sampling_now and not mirror.swapped
            # Values go when known; one not needed by a decode may wait for a later call.
            if values and (decodes or data.draw(st.booleans(), "send")):
                append_ids += [request_id] * len(values)
                append_tokens += values
                sent[request_id] = len(values)
            known = mirror.known_to_allocator + sent.get(request_id, 0)
            if not scheduled or (request_id in sampling_now and mirror.swapped):
                continue  # (swapped: it comes back once its sampled token is known)
            if decodes:
                decode_ids.append(request_id)  # its next token is being sampled
            elif request_id not in sampling_now and known > mirror.computed:
                items.append(StepItem(request_id, chunk))
        for prompt, salt, num in prompts:
            request_id = f"r{self.next_id}"
            self.next_id += 1
            self.requests[request_id] = Mirror(salt, list(prompt))
            items.append(StepItem(request_id, num, list(prompt), salt))
        commit_through = self.executed_through if confirm else 0
        if not (items or decode_ids or append_ids or free_ids or abort_ids or commit_through):
            return  # nothing to send (an empty Step is refused): the batch keeps executing
        self.step_id += 1
        result = self.allocator.step(
            "p", self.pool.epoch, self.lease_id,
            StepCall(items, PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE,
                free_request_ids=free_ids, abort_request_ids=abort_ids,
                append_request_ids=append_ids, append_token_ids=append_tokens,
                decode_request_ids=decode_ids, step_id=self.step_id,
                commit_through_step_id=commit_through))
        for request_id, num in sent.items():
            self.requests[request_id].known_to_allocator += num
        for request_id in free_ids:
            del self.requests[request_id]

        # 2. The Step is back: a prefix hit must already hold the request's tokens.
        grants = {g.request_id: g for g in result.all_grants(BLOCK_SIZE)}
        for item in items:
            grant = grants.get(item.request_id)
            if item.prompt_token_ids is not None and grant is not None:
                mirror = self.requests[item.request_id]
                hit = grant.block_ids[: grant.num_cached_tokens // BLOCK_SIZE]
                assert self._read(hit, grant.num_cached_tokens) == self._expect(
                    mirror, grant.num_cached_tokens
                ), f"{item.request_id}: a prefix hit on KV not written yet"

        # 3. The batch in flight executes (after the Step, before the next batch): its copies
        # first, then its writes; or it fails, and nothing of it is applied.
        self.last_batch_failed = bool(self.in_flight or self.in_flight_ops) and data.draw(
            st.integers(0, 9), "fail"
        ) == 0
        if self.last_batch_failed:
            self.failed = {w.request_id for w in self.in_flight} | self.in_flight_swapped
            self.failed &= set(self.requests)
            self.in_flight, self.in_flight_ops = [], ([], [], [])
        else:
            self.executed_through = self.in_flight_step
        swap_out, swap_in, copies = self.in_flight_ops
        for c in swap_out:
            self.cpu[c.dst_block_id] = list(self.gpu[c.src_block_id])
        for c in swap_in:
            self.gpu[c.dst_block_id] = list(self.cpu[c.src_block_id])
        for c in copies:
            self.gpu[c.dst_block_id] = list(self.gpu[c.src_block_id])
        for work in self.in_flight:
            assert self._read(work.table, work.start) == self._expect(work.mirror, work.start), (
                f"{work.request_id} reads foreign KV"
            )
            for p in range(work.start, work.start + work.num):
                self.gpu[work.table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = (
                    work.mirror.salt, p, work.mirror.tokens[p],
                )
            if work.sample:
                end = work.start + work.num
                assert len(work.mirror.tokens) == end, "samples only at its last token"
                work.mirror.tokens.append(_sample(work.mirror.tokens, end))

        # 4. The outcome forms the next batch (the sampled values are known by now); its
        # copies run when it executes. A request of a failed batch is not in it.
        self.in_flight_ops = (result.swap_out, result.swap_in, result.copies)
        self.in_flight_swapped = {
            p.request_id for p in result.preempted if p.mode is PreemptionMode.SWAP
        }
        for p in result.preempted:
            if p.mode is PreemptionMode.SWAP:
                mirror = self.requests[p.request_id]
                mirror.swapped, mirror.table = True, []
            else:
                del self.requests[p.request_id]
        skipped = {p.request_id for p in result.preempted} | set(result.deferred)
        for item in items:
            if item.request_id in skipped and item.prompt_token_ids is not None:
                self.requests.pop(item.request_id, None)
        batch = []
        for request_id in [*decode_ids, *(i.request_id for i in items)]:
            if request_id in skipped:
                continue
            mirror = self.requests[request_id]
            grant = grants.get(request_id)
            if grant is not None:
                mirror.table[grant.delta_start :] = grant.block_ids
                mirror.swapped = False
                start, num = grant.start_position, grant.num_scheduled
                if grant.new_request:
                    mirror.known_to_allocator = len(mirror.tokens)
                    mirror.computed = grant.num_cached_tokens
            else:  # granted without a table change
                start = mirror.computed
                num = 1 if request_id in decode_ids else min(
                    chunk, mirror.known_to_allocator - mirror.computed
                )
            assert start == mirror.computed, f"{request_id}: grant starts where it stands"
            if request_id in decode_ids:
                assert num == 1
                self.num_unknown_granted += start >= mirror.known_to_allocator
            mirror.computed = start + num
            if num and request_id not in self.failed:
                sample = mirror.computed == len(mirror.tokens)
                batch.append(Work(request_id, mirror, start, num, sample, list(mirror.table)))
        self.in_flight = batch
        self.in_flight_step = self.step_id

    @invariant()
    def invariants_hold(self) -> None:
        self.allocator.check_invariants()
        assert set(self.pool.requests) == set(self.requests)
        for request_id, mirror in self.requests.items():
            request = self.pool.requests[request_id]
            assert request.token_ids == mirror.tokens[: mirror.known_to_allocator]
            assert request.num_computed == mirror.computed
            assert request.num_computed <= len(request.token_ids) + 1

    def teardown(self) -> None:
        free_all_and_check_no_leak(self.allocator, self.pool, self.requests, NUM_BLOCKS,
                                   NUM_CPU_BLOCKS, self.lease_id)


OverlapMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=30, deadline=None
)
test_overlapped_steps_against_a_reference = OverlapMachine.TestCase
