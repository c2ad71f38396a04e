"""Stateful property test: KV hand-offs mixed into random Step / Free / Abort / Fork sequences.

The allocator machine of test_allocator_properties.py (its gateway mirror, shadow KV cache,
event observer and leak check), with one more rule: a request handed off into the pool. Its
table must share exactly the device-cached prefix of its tokens (by an independent chain
hash) and read back this salt's KV there; fresh blocks, private, hold the rest, which the
move then writes. From there it runs, commits, forks, is preempted and freed like any.

The same rule joins test_cpu_tier_properties' machine (pins, a CPU tier, refused steps):
a hand-off never hits in the tier, and the cached blocks it evicts never become tier entries
(no step copies their KV there: the tier's reference would not hold it).
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_allocator_properties import BLOCK_SIZE, SALTS, AllocatorMachine, Mirror
from test_cpu_tier_properties import CpuTierMachine

from allocator_svc.core.hand_off import HandOff
from allocator_svc.core.pool import Pool
from common.block_hash import hash_chain
from common.errors import AlreadyExists, ResourceExhausted
from tests.budget import examples


def snapshot(pool: Pool) -> tuple[Any, ...]:
    return ([b.block_id for b in pool.blocks.free_queue], dict(pool.blocks.cached),
            [b.ref_count for b in pool.blocks.blocks], sorted(pool.requests),
            pool.events.last_seq)


class HandOffMachine(AllocatorMachine):
    def _call(self, request_id: str, tokens: list[int], prompt: int, salt: str) -> HandOff:
        return HandOff("p", self.pool.epoch, None, request_id, tokens, prompt, salt, "", "fp",
                       BLOCK_SIZE)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9),
          salt=st.sampled_from(SALTS), prompt=st.integers(0, 9), data=st.data())
    def hand_off(self, tokens: list[int], salt: str, prompt: int, data: st.DataObject) -> None:
        pool, request_id = self.pool, f"r{self.next_id}"
        self.next_id += 1
        # Often a prefix committed before (cached, unless evicted since): hits.
        committed = sorted(self.committed_prefixes[salt])
        if committed and data.draw(st.booleans()):
            tokens = list(data.draw(st.sampled_from(committed))) + tokens[:3]
        # The model: the longest run of the tokens' full blocks cached on the device.
        shared = []
        for block_hash in hash_chain(pool.root(salt), tokens, BLOCK_SIZE):
            block = pool.blocks.cached.get(block_hash)
            if block is None:
                break
            shared.append(block)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        needed = num_blocks - len(shared) + sum(1 for b in shared if b.ref_count == 0)
        before = snapshot(pool)
        try:
            request = self.allocator.reserve_hand_off(
                self._call(request_id, list(tokens), min(prompt, len(tokens)), salt))
        except ResourceExhausted:
            assert needed > pool.blocks.num_free and snapshot(pool) == before
            return
        table = [b.block_id for b in request.blocks]
        num_cached = len(shared) * BLOCK_SIZE
        assert table[: len(shared)] == [b.block_id for b in shared]
        assert len(table) == num_blocks and request.num_cached_tokens == num_cached
        assert all(b.ref_count == 1 for b in request.blocks[len(shared):]), "fresh, private"
        mirror = Mirror(salt, list(tokens), len(tokens), table)
        assert self._read(mirror, num_cached) == self._expect(mirror, num_cached), (
            f"{request_id} shares foreign KV"
        )
        for p in range(num_cached, len(tokens)):  # the move: the source's KV lands here
            self.gpu[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = (salt, p, tokens[p])
        self.requests[request_id] = mirror
        self.pending_commits[request_id] = len(tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def hand_off_an_id_the_pool_holds(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        before = snapshot(self.pool)
        try:
            self.allocator.reserve_hand_off(self._call(request_id, [1], 1, ""))
        except AlreadyExists:
            assert snapshot(self.pool) == before
        else:
            raise AssertionError(f"{request_id} reserved twice")


HandOffMachine.TestCase.settings = settings(max_examples=examples(350), stateful_step_count=30,
                                            deadline=None)
test_hand_off_random_operation_sequences = HandOffMachine.TestCase


class TieredHandOffMachine(CpuTierMachine, HandOffMachine):
    pass


TieredHandOffMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=30, deadline=None)
test_hand_off_with_a_cpu_tier_random_operation_sequences = TieredHandOffMachine.TestCase
