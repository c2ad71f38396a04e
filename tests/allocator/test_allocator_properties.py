"""Stateful property test: random operation sequences against a simple reference model.

The reference plays both the gateway (mirrors every block table from the deltas it is sent)
and the executor (a shadow KV cache: each slot remembers which salt/position/token wrote it,
and copy/swap operations move those records). After every operation the allocator's
invariants hold, and every request's computed prefix reads back exactly its own tokens from
the slots its mirrored table points at: prefix hits, copy-on-write and swap are all checked by
what an executor would actually read.

An observer follows the event log (small pages, a log small enough to overflow) and must
rebuild exactly the allocator's prefix-cache map; every BlockStored event's parent and tokens
must reproduce its block hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from no_leak import free_all_and_check_no_leak

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.events import EventKind
from allocator_svc.core.hashing import hash_block
from allocator_svc.core.pool import PoolConfig
from allocator_svc.core.victims import PreemptionPolicy
from common.step_records import Commit, PreemptionMode, StepCall, StepItem
from tests.budget import examples

BLOCK_SIZE = 2
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 6
EVENT_CAPACITY = 8  # small: the observer's cursor regularly falls off the log
SALTS = ("", "tenant")

Slot = tuple[str, int, int]  # (salt, position, token) that wrote the slot


@dataclass
class Mirror:
    """What the gateway and executor know of one request."""

    salt: str
    tokens: list[int]
    computed: int = 0
    table: list[int] = field(default_factory=list)
    swapped: bool = False


class AllocatorMachine(RuleBasedStateMachine):
    POLICY = PreemptionPolicy.TAIL

    def __init__(self) -> None:
        super().__init__()
        self.allocator = Allocator(Limits(max_batch_items=64, event_capacity=EVENT_CAPACITY),
                                   preemption_policy=self.POLICY)
        self.pool, _ = self.allocator.register_pool(
            PoolConfig("p", NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, "fp", "i", True)
        )
        self.gpu: dict[int, list[Slot | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.cpu: dict[int, list[Slot | None]] = {
            b: [None] * BLOCK_SIZE for b in range(NUM_CPU_BLOCKS)
        }
        self.requests: dict[str, Mirror] = {}
        self.pending_commits: dict[str, int] = {}
        self.next_id = 0
        self.step_id = 0
        self.committed_prefixes: dict[str, set[tuple[int, ...]]] = {s: set() for s in SALTS}
        self.observed: dict[bytes, int] = {}  # block hash -> block id, rebuilt from events
        self.cursor = 0

    # Helpers: the executor's view.
    def _read(self, mirror: Mirror, upto: int) -> list[Slot | None]:
        return [self.gpu[mirror.table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(upto)]

    def _expect(self, mirror: Mirror, upto: int) -> list[Slot]:
        return [(mirror.salt, p, mirror.tokens[p]) for p in range(upto)]

    def _apply(self, result, scheduled: dict[str, int], items: list[StepItem]) -> None:
        for p in result.preempted:
            mirror = self.requests[p.request_id]
            if p.mode is PreemptionMode.SWAP:
                mirror.swapped, mirror.table = True, []
            else:
                del self.requests[p.request_id]
            self.pending_commits.pop(p.request_id, None)
        for c in result.swap_out:
            self.cpu[c.dst_block_id] = list(self.gpu[c.src_block_id])
        for c in result.swap_in:
            self.gpu[c.dst_block_id] = list(self.cpu[c.src_block_id])
        for c in result.copies:
            self.gpu[c.dst_block_id] = list(self.gpu[c.src_block_id])
        grants = {g.request_id: g for g in result.all_grants(BLOCK_SIZE)}
        skipped = {p.request_id for p in result.preempted} | set(result.deferred)
        for item in items:
            if item.request_id in skipped:
                if item.request_id in self.requests and item.prompt_token_ids:
                    del self.requests[item.request_id]
                continue
            mirror = self.requests[item.request_id]
            grant = grants.get(item.request_id)
            if grant is not None:
                mirror.table[grant.delta_start :] = grant.block_ids
                mirror.swapped = False
                start, num = grant.start_position, grant.num_scheduled
                if grant.new_request:
                    mirror.computed = grant.num_cached_tokens
                    prefix = tuple(mirror.tokens[: grant.num_cached_tokens])
                    assert not prefix or prefix in self.committed_prefixes[mirror.salt], (
                        "prefix hit on something never committed under this salt"
                    )
            else:
                start, num = mirror.computed, scheduled[item.request_id]
            assert start == mirror.computed, "grant starts where the request stands"
            assert self._read(mirror, start) == self._expect(mirror, start), (
                f"{item.request_id} reads foreign KV"
            )
            for p in range(start, start + num):
                self.gpu[mirror.table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = (
                    mirror.salt,
                    p,
                    mirror.tokens[p],
                )
            mirror.computed = start + num
            self.pending_commits[item.request_id] = mirror.computed

    def _commits(self) -> list[Commit]:
        commits = [Commit(r, n) for r, n in self.pending_commits.items() if r in self.requests]
        for c in commits:
            mirror = self.requests[c.request_id]
            for end in range(BLOCK_SIZE, c.num_computed_tokens + 1, BLOCK_SIZE):
                self.committed_prefixes[mirror.salt].add(tuple(mirror.tokens[:end]))
        self.pending_commits = {}
        return commits

    @rule(
        prompts=st.lists(
            st.tuples(
                st.lists(st.integers(0, 2), min_size=1, max_size=9),
                st.sampled_from(SALTS),
                st.integers(1, 9),
                st.integers(0, 2),  # priority level (by cost, the least urgent go first)
            ),
            max_size=3,
        ),
        decode_tokens=st.lists(st.integers(0, 2), max_size=8),
        swap=st.booleans(),
        commit_previous=st.booleans(),
        columnar=st.booleans(),
        shuffle=st.randoms(use_true_random=False),
    )
    def step(self, prompts, decode_tokens, swap, commit_previous, columnar, shuffle) -> None:
        items, scheduled, appended = [], {}, []
        running = [r for r, m in self.requests.items()]
        shuffle.shuffle(running)
        for rid, token in zip(running, decode_tokens, strict=False):
            mirror = self.requests[rid]
            if mirror.computed == len(mirror.tokens):
                mirror.tokens.append(token)
                appended.append(rid)
            items.append(StepItem(rid, 1))
            scheduled[rid] = min(1, len(mirror.tokens) - mirror.computed)
        for prompt, salt, chunk, priority in prompts:
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.requests[rid] = Mirror(salt, list(prompt))
            items.append(StepItem(rid, chunk, list(prompt), salt, priority=priority))
        if not items:
            return
        decode_ids: list[str] = []
        if columnar:  # running decodes in the decode column (the gateway's form), first in order
            decode_ids = [rid for rid in appended if not self.requests[rid].swapped]
            plain_ids = set(decode_ids)
            items = ([i for i in items if i.request_id in plain_ids]
                     + [i for i in items if i.request_id not in plain_ids])  # step's order
        mode = PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE
        commits = self._commits()
        # Every batch executes before the next Step: it may confirm the previous step by id
        # (commit_through_step_id) or by one commit per request.
        self.step_id += 1
        result = self.allocator.step(
            "p", self.pool.epoch, None,
            StepCall([i for i in items if i.request_id not in decode_ids], mode,
                [] if commit_previous else commits, append_request_ids=appended,
                append_token_ids=[self.requests[r].tokens[-1] for r in appended],
                decode_request_ids=decode_ids, step_id=self.step_id,
                commit_through_step_id=self.step_id - 1 if commit_previous else 0))
        self._apply(result, scheduled, items)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), abort=st.booleans())
    def free(self, data, abort) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        commits = [] if abort else self._commits()
        if abort:
            self.allocator.abort("p", self.pool.epoch, [rid])
            self.pending_commits.pop(rid, None)
        else:
            self.allocator.free("p", self.pool.epoch, commits, [rid])
        del self.requests[rid]

    @precondition(lambda self: any(not m.swapped for m in self.requests.values()))
    @rule(data=st.data(), num_children=st.integers(1, 2))
    def fork(self, data, num_children) -> None:
        rid = data.draw(
            st.sampled_from(sorted(r for r, m in self.requests.items() if not m.swapped))
        )
        parent = self.requests[rid]
        children = [f"r{self.next_id + i}" for i in range(num_children)]
        self.next_id += num_children
        forked = self.allocator.fork("p", self.pool.epoch, rid, children)
        for child, req in zip(children, forked, strict=True):
            self.requests[child] = Mirror(
                parent.salt, list(parent.tokens), parent.computed, [b.block_id for b in req.blocks]
            )
            if rid in self.pending_commits:
                self.pending_commits[child] = self.pending_commits[rid]

    @precondition(lambda self: any(not m.swapped for m in self.requests.values()))
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=5),
          bonus=st.integers(0, 2))
    def speculate(self, data, drafts, bonus) -> None:
        """A decode verifying drafts (speculative decoding): its step writes every draft's KV
        into the lookahead slots; the next call appends the accepted drafts and the token
        after them and accepts them. A rejected draft's slot holds a record of its own, so a
        later read of it as computed (or a prefix hit on a block holding it) fails."""
        rid = data.draw(
            st.sampled_from(sorted(r for r, m in self.requests.items() if not m.swapped)))
        mirror = self.requests[rid]
        appended = []
        if mirror.computed == len(mirror.tokens):  # a sampled token, as a decode appends
            appended = [data.draw(st.integers(0, 2))]
        if mirror.computed != len(mirror.tokens) + len(appended) - 1:
            return  # a prompt still being computed: drafts follow only the last token
        room = NUM_BLOCKS * BLOCK_SIZE - len(mirror.tokens) - len(appended)  # the pool's slots
        if room <= 0:
            return
        mirror.tokens += appended
        self.step_id += 1
        item = StepItem(rid, 1, num_lookahead=min(len(drafts), room))
        result = self.allocator.step("p", self.pool.epoch, None, StepCall(
            [item], commits=self._commits(), step_id=self.step_id,
            append_request_ids=[rid] * len(appended), append_token_ids=appended))
        self._apply(result, {rid: 1}, [item])
        if rid not in self.requests or self.requests[rid].swapped:
            return  # it preempted itself: no lookahead was granted
        # Lookahead comes from free blocks only: as many drafts as it got slots for.
        drafts = drafts[:next(g for g in result.grants if g.request_id == rid).num_lookahead]
        accepted = data.draw(st.integers(0, len(drafts)))
        start = mirror.computed  # after its known token
        for i, draft in enumerate(drafts):
            position = start + i
            salt = mirror.salt if i < accepted else "rejected draft"
            self.gpu[mirror.table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = (
                salt, position, draft)
        landed = [*drafts[:accepted], bonus]
        mirror.tokens += landed
        self.allocator.step("p", self.pool.epoch, None, StepCall(
            append_request_ids=[rid] * len(landed), append_token_ids=landed,
            accept_request_ids=[rid], accept_counts=[accepted]))
        mirror.computed += accepted
        self.pending_commits[rid] = mirror.computed

    @invariant()
    def invariants_hold(self) -> None:
        self.allocator.check_invariants()
        assert set(self.pool.requests) == set(self.requests)

    @invariant()
    def observer_follows_the_cache(self) -> None:
        roots = {self.pool.root(salt) for salt in SALTS}
        while True:
            page = self.pool.events.after(self.cursor, 3)
            if page.truncated:  # fell off the log: resync from a snapshot
                self.observed = {h: b.block_id for h, b in self.pool.blocks.cached.items()}
                self.cursor = page.last_seq
                continue
            for event in page.events:
                assert event.seq == self.cursor + 1, "events arrive without gaps"
                self.cursor = event.seq
                if event.kind is EventKind.REMOVED:
                    assert self.observed.pop(event.block_hash) == event.block_id
                    continue
                assert event.token_ids is not None and len(event.token_ids) == BLOCK_SIZE
                parents = roots if event.parent_hash is None else {event.parent_hash}
                assert event.block_hash in {hash_block(p, event.token_ids) for p in parents}
                assert event.block_hash not in self.observed
                self.observed[event.block_hash] = event.block_id
            if not page.events:
                break
        assert self.cursor == self.pool.events.last_seq
        assert self.observed == {h: b.block_id for h, b in self.pool.blocks.cached.items()}

    def teardown(self) -> None:
        free_all_and_check_no_leak(self.allocator, self.pool, self.requests, NUM_BLOCKS,
                                   NUM_CPU_BLOCKS)


AllocatorMachine.TestCase.settings = settings(
    max_examples=examples(400), stateful_step_count=30, deadline=None
)
test_allocator_random_operation_sequences = AllocatorMachine.TestCase


class CostPolicyMachine(AllocatorMachine):
    """The same operations and checks, with victims chosen by cost (victims.py)."""

    POLICY = PreemptionPolicy.COST


CostPolicyMachine.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=30, deadline=None
)
test_allocator_random_operation_sequences_preempting_by_cost = CostPolicyMachine.TestCase
