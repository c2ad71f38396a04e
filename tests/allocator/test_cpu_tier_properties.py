"""Stateful property test: the allocator's random operation sequences with pins
(test_pin_properties' machine, itself test_allocator_properties' gateway/executor reference)
in a pool whose prefix cache has a CPU tier, and steps the executor refuses.

The executor reference applies a step's swap-outs (preempted requests' blocks and evicted
cached blocks), then its swap-ins (swapped-in requests and CPU-tier hits), then its copies, as
the executor does; a refused step applies nothing, and the gateway reference aborts the
requests it scheduled and the ones it swapped out, before the next call confirms it. The
reference model of the tier: every committed prefix's hash, and the KV its last block holds.
After every operation, besides the base machines' checks (each request reads back exactly its
own tokens, so every CPU-tier hit copied back the right KV): each CPU-tier entry lookups can
find holds, in the reference's CPU blocks, exactly the KV of the committed block its hash
names; the tier holds at most its capacity; hits are counted by tier.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_allocator_properties import BLOCK_SIZE, NUM_BLOCKS, NUM_CPU_BLOCKS, SALTS, Mirror
from test_pin_properties import FRACTION, PinnedAllocatorMachine

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.step_records import PreemptionMode, StepCall, StepItem
from tests.budget import examples

NUM_CPU_CACHE_BLOCKS = 4  # of the 6 CPU blocks: swap-outs may take them all


class CpuTierMachine(PinnedAllocatorMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = Allocator(Limits(max_batch_items=64, event_capacity=8,
                                          max_pinned_fraction=FRACTION))
        self.pool, _ = self.allocator.register_pool(PoolConfig(
            "p", NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, "fp", "i", True,
            NUM_CPU_CACHE_BLOCKS))
        self.hashes: dict[tuple[str, tuple[int, ...]], bytes] = {}  # committed prefix -> hash
        # Two more gateways' leases on the pool, each with its own step ids.
        self.leases = {self.allocator.create_lease(600).lease_id: 0 for _ in range(2)}

    @precondition(lambda self: any(self.committed_prefixes.values()))
    @rule(data=st.data(), extra=st.integers(0, 2),
          pressure=st.lists(st.integers(3, 5), min_size=5, max_size=9))
    def two_leases_out_of_order(self, data, extra, pressure) -> None:
        """Lease x admits a returning conversation (CPU hits to copy back), then lease y a
        prompt that evicts; the executor runs y's batch before x's (two gateways' Executes are
        not ordered); then both confirm their steps."""
        salt, prefix = data.draw(st.sampled_from(sorted(
            (s, p) for s, ps in self.committed_prefixes.items() for p in ps)))
        planned = []
        for lease_id, (prompt, prompt_salt) in zip(
                self.leases, ((list(prefix) + [extra], salt), (pressure, "")), strict=True):
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.requests[rid] = Mirror(prompt_salt, list(prompt))
            items = [StepItem(rid, len(prompt), list(prompt), prompt_salt)]
            self.leases[lease_id] += 1
            result = self.allocator.step(
                "p", self.pool.epoch, lease_id,
                StepCall(items, PreemptionMode.RECOMPUTE, step_id=self.leases[lease_id]))
            planned.append((lease_id, result, items))
        for _, result, items in reversed(planned):
            self._apply(result, {}, items)
        for lease_id, _, items in planned:
            rid = items[0].request_id
            if rid in self.pending_commits:  # what its commit_through commits
                mirror = self.requests[rid]
                for end in range(BLOCK_SIZE, self.pending_commits.pop(rid) + 1, BLOCK_SIZE):
                    self.committed_prefixes[mirror.salt].add(tuple(mirror.tokens[:end]))
            self.allocator.free("p", self.pool.epoch, [], [], lease_id,
                                commit_through=self.leases[lease_id])
        self._note_committed()

    @rule(
        prompts=st.lists(
            st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=9),
                      st.sampled_from(SALTS), st.integers(1, 9)),
            max_size=3,
        ),
        decode_tokens=st.lists(st.integers(0, 2), max_size=8),
        swap=st.booleans(),
        data=st.data(),
        launched_ahead=st.booleans(),
    )
    def refused_step(self, prompts, decode_tokens, swap, data, launched_ahead) -> None:
        """A step whose batch the executor refuses: nothing of it reaches the KV; the gateway
        aborts what it scheduled and what it swapped out; the next step confirms through it.
        `launched_ahead`: the step after it, returning conversations only, was planned before
        the refusal was known, and runs."""
        items, append_ids, append_tokens = [], [], []
        for rid, token in zip(sorted(self.requests), decode_tokens, strict=False):
            mirror = self.requests[rid]
            if mirror.computed == len(mirror.tokens):  # its next token's value, now known
                mirror.tokens.append(token)
                append_ids.append(rid)
                append_tokens.append(token)
            items.append(StepItem(rid, 1))
        for prompt, salt, chunk in prompts:
            items.append(StepItem(f"r{self.next_id}", chunk, list(prompt), salt))
            self.next_id += 1
        if not items:
            return
        self.step_id += 1
        mode = PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE
        result = self.allocator.step(
            "p", self.pool.epoch, None,
            StepCall(items, mode, append_request_ids=append_ids, append_token_ids=append_tokens,
                     step_id=self.step_id))
        deferred = set(result.deferred)  # new ones never held; swapped ones stay swapped
        skipped = {i.request_id for i in items if i.request_id in deferred
                   and i.prompt_token_ids} | {p.request_id for p in result.preempted
                                              if p.mode is PreemptionMode.RECOMPUTE}
        failed = [i.request_id for i in items if i.request_id not in skipped | deferred]
        failed += [p.request_id for p in result.preempted if p.mode is PreemptionMode.SWAP]
        for rid in skipped:  # never admitted, or freed by the allocator
            self.requests.pop(rid, None)
            self.pending_commits.pop(rid, None)
        if launched_ahead and any(self.committed_prefixes.values()):
            self.returning(data, 0, 9, confirm=False)  # the refused step is not confirmed
        failed = sorted(set(failed) & set(self.pool.requests))
        if failed:
            self.allocator.abort("p", self.pool.epoch, failed)
        for rid in failed:
            self.requests.pop(rid, None)
            self.pending_commits.pop(rid, None)

    @precondition(lambda self: any(self.committed_prefixes.values()))
    @rule(data=st.data(), extra=st.integers(0, 2), chunk=st.integers(1, 9))
    def returning(self, data, extra, chunk, confirm=True) -> None:
        """A conversation comes back: a committed prefix and one more token (a likely hit in
        either tier). `confirm`: the step confirms the one before it by id."""
        salt, prefix = data.draw(st.sampled_from(sorted(
            (s, p) for s, ps in self.committed_prefixes.items() for p in ps)))
        self.step([(list(prefix) + [extra], salt, chunk, 0)], [], False, confirm, False,
                  random.Random(0))

    @rule(prompts=st.lists(st.lists(st.integers(3, 5), min_size=5, max_size=9), min_size=1,
                           max_size=3),
          swap=st.booleans(), free=st.booleans())
    def pressure(self, prompts, swap, free) -> None:
        """Prompts sharing nothing with the others: their blocks evict cached ones (into the
        tier)."""
        first = self.next_id
        self.step([(p, "", len(p), 0) for p in prompts], [], swap, True, False, random.Random(0))
        done = [r for r in (f"r{i}" for i in range(first, self.next_id)) if r in self.requests]
        if free and done:
            self.allocator.free("p", self.pool.epoch, self._commits(), done)
            for rid in done:
                del self.requests[rid]

    @precondition(lambda self: self.step_id > 0)
    @rule()
    def confirm_steps(self) -> None:
        """The gateway confirms every step executed so far (an idle engine's Free)."""
        self._commits()  # what the last step computed is committed through it
        self.allocator.free("p", self.pool.epoch, [], [], commit_through=self.step_id)

    def _commits(self):
        commits = super()._commits()
        self._note_committed()
        return commits

    def _note_committed(self) -> None:
        for salt, prefixes in self.committed_prefixes.items():
            for prefix in prefixes:
                if (salt, prefix) not in self.hashes:
                    self.hashes[salt, prefix] = self.pool.chain(salt, list(prefix))[-1]

    @invariant()
    def cpu_tier_holds_committed_kv(self) -> None:
        tier = self.pool.cpu
        assert len(tier.entries) <= NUM_CPU_CACHE_BLOCKS
        by_hash = {h: key for key, h in self.hashes.items()}
        for block_hash, entry in tier.entries.items():
            if not entry.written:
                continue
            known = by_hash.get(block_hash)
            assert known is not None, f"CPU entry {entry.cpu_block_id} was never committed"
            salt, prefix = known
            start = len(prefix) - BLOCK_SIZE
            expected = [(salt, start + i, prefix[start + i]) for i in range(BLOCK_SIZE)]
            assert self.cpu[entry.cpu_block_id] == expected, (
                f"CPU entry {entry.cpu_block_id} does not hold its block's KV"
            )
        assert 0 <= self.pool.num_prefix_cpu_hits <= self.pool.num_prefix_hits


CpuTierMachine.TestCase.settings = settings(
    max_examples=examples(400), stateful_step_count=30, deadline=None
)
test_cpu_tier_random_operation_sequences = CpuTierMachine.TestCase
