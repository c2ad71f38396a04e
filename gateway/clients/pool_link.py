"""One executor and its KV pool at the allocator, as one engine talks to them.

Holds the pool's identity (pool_id, the epoch to send, the executor's description) and the
lease the pool's requests join; every call an engine makes goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from common.executor_description import ExecutorDescription
from common.step_records import Commit, StepCall
from gateway.clients.allocator_client import AllocatorClient, HandOffReservation, PoolSpec
from gateway.clients.executor_client import ExecutorClient, KVImport
from gateway.clients.lease import Lease
from gateway.core.step import ExecuteCall, ExecuteResult, StepOutcome, TableDelta

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class PoolLink:
    pool_id: str
    executor: ExecutorClient
    allocator: AllocatorClient
    lease: Lease
    description: ExecutorDescription
    enable_prefix_caching: bool
    execute_timeout_s: float | None = None  # Execute and Release; allocator calls: its client
    num_shards: int = 1  # allocator shards: the pool's shard checks that it counts alike
    epoch: int = 0
    # The lease our requests were admitted under, and its generation. Calls name this one,
    # not the lease's newest: a lease replaced while a step was being planned (a keep-alive
    # found it gone) must not admit requests the engine believes the allocator forgot; the
    # engine takes the renewal first (take_lease_renewal), or the call fails as stale.
    lease_generation: int = 0
    lease_id: str = ""

    async def register(self) -> None:
        """(Re-)register the pool; a new executor instance resets it at the allocator."""
        d = self.description
        self.epoch = await self.allocator.register_pool(
            PoolSpec(
                pool_id=self.pool_id,
                num_blocks=d.num_blocks,
                block_size=d.block_size,
                num_cpu_blocks=d.num_cpu_blocks,
                model_fingerprint=d.model_fingerprint,
                executor_instance_id=d.instance_id,
                enable_prefix_caching=self.enable_prefix_caching,
                executor_address=self.executor.address,
                num_shards=self.num_shards,
                num_cpu_cache_blocks=d.num_cpu_cache_blocks,
            )
        )
        # Requests admitted from now on join the current lease.
        self.lease_generation, self.lease_id = self.lease.generation, self.lease.lease_id
        log.info("pool_registered", pool_id=self.pool_id, epoch=self.epoch,
                 num_blocks=d.num_blocks, executor_instance_id=d.instance_id)

    async def refresh(self, timeout_s: float) -> None:
        """Describe the executor again (it may have restarted), then register."""
        self.description = await self.executor.describe(timeout=timeout_s)
        await self.register()

    @property
    def lease_renewed(self) -> bool:
        """The lease was replaced since the pool was registered under it."""
        return self.lease.generation != self.lease_generation

    def take_lease_renewal(self) -> bool:
        """True once after the lease was replaced: the allocator forgot our requests."""
        if self.lease.generation == self.lease_generation:
            return False
        self.lease_generation, self.lease_id = self.lease.generation, self.lease.lease_id
        return True

    async def step(self, call: StepCall) -> StepOutcome:
        return await self.allocator.step(self.pool_id, self.epoch, self.lease_id, call)

    async def execute(
        self, call: ExecuteCall, step_id: int = 0, previous_step_id: int = 0
    ) -> ExecuteResult:
        """Launched ahead (`previous_step_id`), the call also waits at the executor for the
        one before it: it gets that one's deadline as well as its own."""
        timeout = self.execute_timeout_s
        if timeout is not None and previous_step_id:
            timeout *= 2
        return await self.executor.execute(call, timeout, step_id, previous_step_id)

    async def free(
        self, commits: Sequence[Commit], request_ids: Sequence[str], commit_through_step_id: int
    ) -> int:
        """The pool's free blocks once applied (as `abort`'s)."""
        return await self.allocator.free(self.pool_id, self.epoch, commits, request_ids,
                                         self.lease_id, commit_through_step_id)

    async def abort(self, request_ids: Sequence[str]) -> int:
        return await self.allocator.abort(self.pool_id, self.epoch, request_ids, self.lease_id)

    async def release(self, request_ids: Sequence[str]) -> None:
        await self.executor.release(request_ids, timeout=self.execute_timeout_s)

    async def fork(
        self, parent_id: str, child_ids: Sequence[str], request_id: str
    ) -> list[TableDelta]:
        return await self.allocator.fork(self.pool_id, self.epoch, parent_id, child_ids,
                                         request_id, self.lease_id)

    async def reserve_hand_off(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        cache_salt: str,
        tenant: str,
        source_model_fingerprint: str,
        source_block_size: int,
        source_pool_id: str,
        client_request_id: str,
        priority: int = 0,
    ) -> HandOffReservation:
        """Reserve, in this (the target) pool, a request whose KV another pool's executor
        holds; it joins our lease. Commit it once the KV has moved here, or abort it."""
        return await self.allocator.reserve_hand_off(
            self.pool_id, self.epoch, request_id, token_ids, num_prompt_tokens, cache_salt,
            tenant, source_model_fingerprint, source_block_size, source_pool_id,
            client_request_id, self.lease_id, priority)

    async def import_kv(
        self, source: PoolLink, request_id: str, first_block_index: int,
        block_ids: Sequence[int], num_tokens: int, timeout_s: float | None,
        previous_step_id: int = 0,
    ) -> KVImport:
        """This executor pulls a request's KV from `source`'s executor into `block_ids`
        (table indices from `first_block_index` on: those before are cached here), writing
        them after its Execute `previous_step_id` (0: none out)."""
        return await self.executor.import_kv(source.executor.address, request_id,
                                             first_block_index, block_ids, num_tokens,
                                             timeout=timeout_s,
                                             previous_step_id=previous_step_id)
