"""One executor's pool: block pool, CPU blocks and the requests holding blocks of it.

Every operation on a request lives here, so the ways a block table changes are on one page:
admit (with prefix lookup in both tiers), allocate (with copy-on-write), commit, free, fork,
swap out/in (and a hand-off's reservation: hand_off.py). Operations that can fall short
return None and change nothing; callers validate arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from allocator_svc.core.block_pool import BlockPool
from allocator_svc.core.cpu_blocks import CpuBlocks, CpuEntry, TierOps
from allocator_svc.core.events import EventLog
from allocator_svc.core.free_queue import Block
from allocator_svc.core.hashing import BlockHasher, pack_tokens, root_hash
from allocator_svc.core.pins import PinTable
from allocator_svc.core.request import Grant, Request
from allocator_svc.core.scheduled_steps import ScheduledSteps, StepHolds
from allocator_svc.core.tenant_service import TenantService
from common.step_records import BlockCopy

MAX_CACHED_ROOTS = 4096


@dataclass(frozen=True, slots=True)
class PoolConfig:
    pool_id: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    model_fingerprint: str
    executor_instance_id: str
    enable_prefix_caching: bool
    # Of num_cpu_blocks, how many may hold the prefix cache's CPU tier (0: no tier).
    num_cpu_cache_blocks: int = 0


class Pool:
    def __init__(
        self, config: PoolConfig, epoch: int, event_capacity: int, pin_budget: int = 0
    ) -> None:
        self.config = config
        self.epoch = epoch
        self.block_size = config.block_size
        self.events = EventLog(event_capacity)
        self.blocks = BlockPool(config.num_blocks, config.enable_prefix_caching, self.events)
        self.pins = PinTable(self.blocks, pin_budget)  # the operator's pinned prefixes
        tier = config.num_cpu_cache_blocks if config.enable_prefix_caching else 0
        self.cpu = CpuBlocks(config.num_cpu_blocks, tier)
        if tier:
            self.blocks.cpu_tier = self.cpu
        self.requests: dict[str, Request] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up at admission
        self.num_prefix_hits = 0  # of which served from the cache
        self.num_prefix_cpu_hits = 0  # of which copied back from the CPU tier
        # The same for requests readmitted after a recompute preemption (not in the above).
        self.num_resumed_prefix_queries = 0
        self.num_resumed_prefix_hits = 0
        self.num_preemptions = 0
        self.num_cow_copies = 0  # copy-on-write copies planned (a forked child's shared block)
        self.num_swap_outs = self.num_swapped_out_blocks = 0  # requests, blocks moved to CPU
        self.num_swap_ins = self.num_swapped_in_blocks = 0  # and back
        # Hand-offs reserved (hand_off.py), their tokens and those found cached: counted
        # apart from the prompts' lookups, whose hit rate they would distort.
        self.num_hand_offs = self.num_hand_off_tokens = self.num_hand_off_cached_tokens = 0
        self._roots: dict[str, bytes] = {}  # cache_salt -> chain root
        self.hash_block = BlockHasher(config.block_size)
        # Per lease, what its steps granted and no call has committed yet (scheduled_steps.py).
        self.scheduled = ScheduledSteps(self.cpu, self.blocks)
        # The step being built: the device blocks its swap-outs copy from (StepHolds).
        self.swapped_out_sources: list[Block] = []
        # The allocator's ledger of tenants' service, charged by every step (None: none).
        self.tenant_service: TenantService | None = None
        # Requests holding lookahead slots not settled yet (speculative decoding).
        self.lookahead: set[Request] = set()

    def root(self, cache_salt: str) -> bytes:
        root = self._roots.get(cache_salt)
        if root is None:
            if len(self._roots) >= MAX_CACHED_ROOTS:  # a salt per request must not grow this
                self._roots.clear()
            root = self._roots[cache_salt] = root_hash(self.config.model_fingerprint, cache_salt)
        return root

    @property
    def free_cpu_block_ids(self) -> list[int]:
        return self.cpu.free_ids

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain(self, cache_salt: str, token_ids: list[int]) -> list[bytes]:
        """The block hashes of the full blocks of `token_ids` (a pin's chain)."""
        num_blocks = len(token_ids) // self.block_size
        return self.hash_block.chain_with_keys(self.root(cache_salt), token_ids, num_blocks)[0]

    def match_prefix(
        self, root: bytes, token_ids: list[int], hand_off: bool = False
    ) -> tuple[list[Block | CpuEntry], list[bytes]]:
        """Longest run of cached full blocks, each on the device or else in the CPU tier,
        capped so the last token is always computed. `hand_off`: every token is computed
        already, so every full block may hit, on the device only (hand_off.py)."""
        hits: list[Block | CpuEntry] = []
        hashes: list[bytes] = []
        if not self.config.enable_prefix_caching:
            return hits, hashes
        num_blocks = (len(token_ids) - (0 if hand_off else 1)) // self.block_size
        packed = pack_tokens(token_ids[: num_blocks * self.block_size])
        stride, by_key, parent = 4 * self.block_size, self.blocks.by_key, root
        tier = self.cpu if self.cpu.capacity and not hand_off else None
        for start in range(0, len(packed), stride):
            # Indexed by the hash input: a cached block's hash is read, not recomputed.
            key = parent + packed[start : start + stride]
            hit: Block | CpuEntry | None = by_key.get(key)
            if hit is None and tier is not None:
                hit = tier.lookup(key)
            if hit is None:
                break
            parent = hit.block_hash  # type: ignore[assignment]
            hits.append(hit)
            hashes.append(parent)
        return hits, hashes

    def admit(
        self,
        request: Request,
        num_tokens: int,
        swap_in: list[BlockCopy],
        resumed: bool = False,
        lookup: bool = True,
    ) -> Grant | None:
        """Admit a new request: cached prefix first (CPU-tier hits copied back by `swap_in`),
        then slots for `num_tokens` more. `resumed`: it was preempted by recompute; its lookup
        is counted apart. Without `lookup` it computes every token (and counts no query)."""
        hits, hashes = (self.match_prefix(request.root_hash, request.token_ids) if lookup
                        else ([], []))
        num_cached = len(hits) * self.block_size
        num_scheduled = min(num_tokens, len(request.token_ids) - num_cached)
        on_device = [b for b in hits if isinstance(b, Block)]
        num_new = self.blocks_for(num_cached + num_scheduled) - len(on_device)
        num_revived = sum(1 for block in on_device if block.ref_count == 0)
        if num_new + num_revived > self.blocks.num_free:
            return None
        loaded = len(hits) - len(on_device)
        if loaded:
            request.blocks = self._load_hits(hits, swap_in)
            # NOTE: the loaded blocks hold nothing until this step's swap-ins run: they (and
            # every block after the first) enter the device cache through this step's commit.
            first = next(i for i, b in enumerate(hits) if not isinstance(b, Block))
            hashes = hashes[:first]
        else:
            self.blocks.touch(on_device)
            request.blocks = on_device
        fresh = self.blocks.allocate(num_new - loaded)
        assert fresh is not None, "admission checked the free count"
        request.blocks += fresh
        request.block_hashes = hashes
        request.num_cached_tokens = request.num_computed = request.num_committed = num_cached
        request.num_cpu_cached_tokens = loaded * self.block_size
        # Not its tenant's to pay for (tenant_service.py): what it found cached, and, back
        # from a recompute preemption, what it had computed before (all but the last token).
        request.num_charged = max(num_cached, len(request.token_ids) - 1 if resumed else 0)
        if self.config.enable_prefix_caching and lookup:
            if resumed:
                self.num_resumed_prefix_queries += len(request.token_ids)
                self.num_resumed_prefix_hits += num_cached
            else:
                self.num_prefix_queries += len(request.token_ids)
                self.num_prefix_hits += num_cached
                self.num_prefix_cpu_hits += request.num_cpu_cached_tokens
        self.requests[request.request_id] = request
        grant = Grant(
            request.request_id,
            0,
            [b.block_id for b in request.blocks],
            num_scheduled,
            num_cached,
            num_cached,
            new_request=True,
            num_cpu_cached_tokens=request.num_cpu_cached_tokens,
        )
        request.num_computed += num_scheduled
        return grant

    def _load_hits(self, hits: list[Block | CpuEntry], swap_in: list[BlockCopy]) -> list[Block]:
        """The table of a prefix with hits in the CPU tier: device hits as they are, a fresh
        block for each CPU hit with a copy into it. The entries are marked busy before any
        allocation, so the evictions it causes never write over them."""
        entries = [h for h in hits if not isinstance(h, Block)]
        for entry in entries:
            self.cpu.load(entry)
        self.blocks.touch(h for h in hits if isinstance(h, Block))
        fresh = self.blocks.allocate(len(entries))
        assert fresh is not None, "admission checked the free count"
        loads = iter(fresh)
        table: list[Block] = []
        for hit in hits:
            if isinstance(hit, Block):
                table.append(hit)
            else:
                block = next(loads)
                swap_in.append(BlockCopy(hit.cpu_block_id, block.block_id))
                table.append(block)
        return table

    def blocks_needed(self, request: Request, num_tokens: int, lookahead: int = 0) -> int:
        """Free blocks `allocate` would take: new slots plus a copy-on-write copy."""
        needed = (self.blocks_for(request.num_computed + num_tokens + lookahead)
                  - len(request.blocks))
        return max(needed, 0) + self._needs_copy(request, num_tokens)

    def _needs_copy(self, request: Request, num_tokens: int) -> int:
        offset = request.num_computed % self.block_size
        if num_tokens == 0 or offset == 0:
            return 0
        return int(request.blocks[request.num_computed // self.block_size].ref_count > 1)

    def allocate(self, request: Request, num_tokens: int, copies: list[BlockCopy]) -> Grant | None:
        """Slots for `num_tokens` more tokens of a running request; None if the pool is short."""
        if self.blocks_needed(request, num_tokens) > self.blocks.num_free:
            return None
        delta_start = len(request.blocks)
        if self._needs_copy(request, num_tokens):
            # NOTE: a forked child writing into a shared partial block gets its own copy.
            index = request.num_computed // self.block_size
            shared = request.blocks[index]
            taken = self.blocks.allocate(1)
            assert taken is not None, "allocate checked the free count"
            private = taken[0]
            copies.append(BlockCopy(shared.block_id, private.block_id))
            self.num_cow_copies += 1
            self.blocks.free([shared])
            request.blocks[index] = private
            delta_start = index
        num_new = self.blocks_for(request.num_computed + num_tokens) - len(request.blocks)
        if num_new > 0:
            fresh = self.blocks.allocate(num_new)
            assert fresh is not None, "allocate checked the free count"
            request.blocks.extend(fresh)
        start = request.num_computed
        request.num_computed += num_tokens
        return Grant(
            request.request_id,
            delta_start,
            [b.block_id for b in request.blocks[delta_start:]],
            num_tokens,
            start,
        )

    def add_lookahead(self, request: Request, grant: Grant, wanted: int) -> None:
        """Slots past a granted request's computed tokens for its drafts (not computed until
        accepted): as many of `wanted` as the free blocks hold, never by taking a block from
        anyone (drafts may be rejected). The grant says how many, its delta covers them."""
        free = self.blocks.num_free
        lookahead = wanted
        while lookahead and self.blocks_needed(request, 0, lookahead) > free:
            lookahead -= 1
        grant.num_lookahead = lookahead
        if not lookahead:
            return
        num_new = self.blocks_for(request.num_computed + lookahead) - len(request.blocks)
        if num_new > 0:
            fresh = self.blocks.allocate(num_new)
            assert fresh is not None, "checked: the free blocks hold them"
            assert grant.delta_start + len(grant.block_ids) == len(request.blocks), (
                "the grant's delta ends the table")
            request.blocks.extend(fresh)
            grant.block_ids.extend(b.block_id for b in fresh)
        request.num_lookahead = lookahead
        self.lookahead.add(request)

    def settle_lookahead(self, request: Request, num_accepted: int) -> None:
        """Its executor verified its drafts: the `num_accepted` first ones count as computed
        (their values are known), and the blocks past what it now computes go back, unhashed.
        A rejected draft's slot is written again before any commit reaches it."""
        assert num_accepted <= request.num_lookahead, "validated: within the lookahead"
        request.num_computed += num_accepted
        request.num_lookahead = 0
        self.lookahead.discard(request)
        keep = self.blocks_for(request.num_computed)
        if len(request.blocks) > keep:
            self.blocks.free(reversed(request.blocks[keep:]))
            del request.blocks[keep:]

    # The commit rule: a full block enters the prefix cache once its KV is written.

    def commit(self, request: Request, num_computed: int) -> None:
        """KV of tokens [0, num_computed) is written: cache the full blocks among them. A block
        holding a token whose value is unknown waits for it (a later commit hashes it)."""
        request.num_committed = max(request.num_committed, num_computed)
        bs = self.block_size
        num_full = min(num_computed, len(request.token_ids)) // bs
        hashes = request.block_hashes
        if len(hashes) >= num_full or request.swapped:
            return
        first = len(hashes)
        tokens = request.token_ids[first * bs : num_full * bs]
        new_hashes, keys = self.hash_block.chain_with_keys(
            hashes[-1] if hashes else request.root_hash, tokens, num_full - first
        )
        self.blocks.cache_run(
            request.blocks[first:num_full],
            new_hashes,
            keys,
            hashes[-1] if hashes else None,
            tokens,
        )
        hashes.extend(new_hashes)


    def commit_run(self, requests: list[Request], counts: Iterable[int]) -> None:
        """Commit each of a step's requests at the count it was granted then. Most decode
        steps fill no block; in one of every block_size steps each request fills one, and those
        are hashed and cached together, as one event run."""
        live, bs = self.requests, self.block_size
        filled: list[Request] = []
        tokens: list[int] = []
        for request, count in zip(requests, counts, strict=True):
            if live.get(request.request_id) is not request:
                continue  # freed or preempted since
            have, num_full = len(request.block_hashes), count // bs
            if num_full == have:
                if count > request.num_committed:
                    request.num_committed = count
            elif self._one_block_filled(request, count, have, num_full):
                filled.append(request)
                tokens.extend(request.token_ids[have * bs : num_full * bs])
        if filled:
            self._cache_one_block_each(filled, tokens)


    def _one_block_filled(
        self, request: Request, count: int, have: int, num_full: int
    ) -> bool:
        """True: the request filled exactly its next block, to be hashed with the step's others.
        Anything else (a prefill chunk, a swapped request, a block holding a token whose value
        is unknown) is committed on its own here."""
        if (num_full != have + 1 or request.cpu_block_ids is not None
                or num_full * self.block_size > len(request.token_ids)):
            self.commit(request, count)
            return False
        request.num_committed = max(request.num_committed, count)
        return True


    def _cache_one_block_each(self, filled: list[Request], tokens: list[int]) -> None:
        """Each request filled its next block with its slice of `tokens`: packed together, each
        hashed over its parent + its slice."""
        blocks: list[Block] = []
        parents: list[bytes] = []
        for request in filled:
            have = len(request.block_hashes)
            parents.append(request.block_hashes[-1] if have else request.root_hash)
            blocks.append(request.blocks[have])
        hashes, keys = self.hash_block.next_blocks(parents, tokens)
        for request, block_hash in zip(filled, hashes, strict=True):
            request.block_hashes.append(block_hash)
        # A chain's first block has no parent block (its parent is the root).
        parent_blocks = [p if r.block_hashes[:-1] else None
                         for p, r in zip(parents, filled, strict=True)]
        self.blocks.cache_blocks(blocks, hashes, keys, parent_blocks, tokens)

    def free(self, request: Request) -> None:
        """Release every block, last first, so prefix blocks outlive suffix blocks in the LRU."""
        del self.requests[request.request_id]
        if request.num_lookahead:
            self.lookahead.discard(request)
            request.num_lookahead = 0
        self.blocks.free(reversed(request.blocks))
        request.blocks = []
        if request.cpu_block_ids is not None:
            self.cpu.release(request.cpu_block_ids)
            request.cpu_block_ids = None

    def abort(self, request: Request) -> None:
        """Free without a commit: a step that scheduled it may have been refused, so the
        CPU-tier copies that step planned are not trusted (scheduled_steps.py)."""
        self.scheduled.aborted(request)
        self.free(request)

    def fork(self, parent: Request, child_ids: list[str]) -> list[Request]:
        if parent.num_lookahead:
            self.settle_lookahead(parent, 0)  # children share computed blocks only
        children = []
        for child_id in child_ids:
            child = Request(
                child_id,
                parent.lease_id,
                parent.root_hash,
                list(parent.token_ids),
                parent.num_prompt_tokens,
                parent.num_computed,
                parent.num_committed,
                list(parent.blocks),
                list(parent.block_hashes),
                num_cached_tokens=parent.num_cached_tokens,
                tenant=parent.tenant,  # its blocks count against the same quota
                priority=parent.priority,
                num_charged=parent.num_computed,  # computed once, for the parent
            )
            self.blocks.touch(child.blocks)
            self.requests[child_id] = child
            children.append(child)
        return children

    def swap_out(self, request: Request) -> list[BlockCopy] | None:
        """Move a request's blocks to CPU blocks (evicting CPU-tier entries if need be); None
        if swap space is short."""
        cpu_ids = self.cpu.take(self.blocks_for(request.num_computed))
        if cpu_ids is None:
            return None
        if request.num_lookahead:
            self.settle_lookahead(request, 0)  # drafts not verified: nothing to move
        copies = [BlockCopy(b.block_id, c) for b, c in zip(request.blocks, cpu_ids, strict=True)]
        self.swapped_out_sources.extend(request.blocks)
        self.blocks.free(reversed(request.blocks))
        request.blocks = []
        request.cpu_block_ids = cpu_ids
        request.num_preemptions += 1
        self.num_swap_outs += 1
        self.num_swapped_out_blocks += len(copies)
        return copies

    def swap_in(self, request: Request, num_tokens: int, swap_in: list[BlockCopy]) -> Grant | None:
        """Bring a swapped request back with room for `num_tokens` more; None if short."""
        cpu_ids = request.cpu_block_ids
        assert cpu_ids is not None, f"{request.request_id} is not swapped out"
        total = self.blocks_for(request.num_computed + num_tokens)
        fresh = self.blocks.allocate(total)
        if fresh is None:
            return None
        swap_in.extend(BlockCopy(c, b.block_id) for c, b in zip(cpu_ids, fresh, strict=False))
        self.scheduled.drop(request)  # older steps' counts must not commit into `fresh`
        self.num_swap_ins += 1
        self.num_swapped_in_blocks += len(cpu_ids)
        self.cpu.release_after_step(cpu_ids)
        request.cpu_block_ids = None
        request.blocks = fresh
        # NOTE: the fresh blocks hold nothing until this step's swap-in copies run, so they
        # re-enter the prefix cache only through the next commit (the commit rule).
        request.block_hashes = []
        start = request.num_computed
        request.num_computed += num_tokens
        return Grant(request.request_id, 0, [b.block_id for b in fresh], num_tokens, start)

    def end_step(self, numbered: bool) -> tuple[list[BlockCopy], TierOps | None, StepHolds | None]:
        """The step is built: its CPU-tier copies and work (cpu_blocks.py), and, for a
        numbered step, the blocks its copies read that it gave up and no one took since,
        held until it is settled (scheduled_steps.py says why)."""
        sources, self.swapped_out_sources = self.swapped_out_sources, []
        returning = self.cpu.take_returning()
        holds = None
        if numbered and (sources or returning):
            device = [b for b in dict.fromkeys(sources) if b.ref_count == 0]
            self.blocks.touch(device)
            holds = StepHolds(device, returning)
        else:
            self.cpu.release(returning)
        ended = self.cpu.end_step()
        copies, tier = ended if ended is not None else ([], None)
        return copies, tier, holds

    def check_invariants(self) -> None:
        held = self.scheduled.held()
        self.blocks.check_invariants([*(r.blocks for r in self.requests.values()),
                                      *(h.device for h in held)])
        self.pins.check_invariants()
        for key, block in self.blocks.by_key.items():
            assert hashlib.sha256(key).digest() == block.block_hash, (
                f"block {block.block_id} is indexed by an input that does not hash to its hash"
            )
        self.cpu.check_invariants(
            [*(c for r in self.requests.values() for c in (r.cpu_block_ids or ())),
             *(c for h in held for c in h.cpu)],
            self.scheduled.unsettled(),
        )
        for key, entry in self.cpu.by_key.items():
            assert hashlib.sha256(key).digest() == entry.block_hash, (
                f"CPU entry {entry.cpu_block_id} is indexed by an input that does not hash to it"
            )
        for request in self.requests.values():
            if not request.swapped:
                assert len(request.blocks) == self.blocks_for(
                    request.num_computed + request.num_lookahead), (
                    f"{request.request_id}: table covers exactly its computed tokens and "
                    "its lookahead"
                )
            assert (request in self.lookahead) == bool(request.num_lookahead), (
                f"{request.request_id}: lookahead not tracked"
            )
            assert request.num_committed <= request.num_computed, (
                f"{request.request_id}: committed past its computed tokens"
            )
            assert request.num_computed <= len(request.token_ids) + 1, (
                f"{request.request_id}: more than one computed token of unknown value"
            )
            hashed = len(request.block_hashes) * self.block_size
            assert hashed <= max(min(request.num_committed, len(request.token_ids)),
                                 request.num_cached_tokens), (
                f"{request.request_id}: a block hashed past its committed, known tokens"
            )
