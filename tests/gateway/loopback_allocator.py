"""A real allocator server in process on a loopback port, with the gateway's real client and
lease, pools registered through real `PoolLink`s, and the server's own count of every RPC it
answered (`calls`): the KV-event index and routing tests' reference."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.victims import PreemptionPolicy
from allocator_svc.service import AllocatorServicer
from common.executor_description import ExecutorDescription
from common.metrics import RpcMetrics
from common.server import Server, start_server
from common.step_records import Commit, StepCall, StepItem
from gateway.clients.allocator_client import AllocatorClient
from gateway.clients.executor_client import ExecutorClient
from gateway.clients.lease import Lease
from gateway.clients.pool_link import PoolLink

SERVICE = "pagedkv.allocator.v1.AllocatorService"


def description(block_size: int = 4, num_blocks: int = 16, fingerprint: str = "fp-test",
                instance_id: str = "instance-0") -> ExecutorDescription:
    return ExecutorDescription(
        instance_id=instance_id, model_name="m", model_fingerprint=fingerprint,
        num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=0, backend="none",
        device="cpu", max_model_len=4096, eos_token_ids=(), vocab_size=1000,
        max_num_batched_tokens=4096, max_num_seqs=64,
    )


@dataclass
class LoopbackAllocator:
    server: Server
    allocator: Allocator
    registry: CollectorRegistry
    client: AllocatorClient
    lease: Lease
    executors: list[ExecutorClient] = field(default_factory=list)  # never called; closed

    @classmethod
    async def start(cls, event_capacity: int = 65536,
                    preemption_policy: PreemptionPolicy = PreemptionPolicy.TAIL,
                    ) -> LoopbackAllocator:
        registry = CollectorRegistry()
        servicer = AllocatorServicer(Allocator(Limits(event_capacity=event_capacity),
                                               preemption_policy=preemption_policy))
        server = await start_server([(servicer, SERVICE)], "127.0.0.1", 0,
                                    rpc_metrics=RpcMetrics(registry))
        client = AllocatorClient(f"127.0.0.1:{server.port}", timeout_s=5)
        lease = Lease(allocator=client, ttl_ms=60_000)
        await lease.acquire()
        return cls(server, servicer.allocator, registry, client, lease)

    async def close(self) -> None:
        await self.client.close()
        for executor in self.executors:
            await executor.close()
        await self.server.server.stop(0)

    def calls(self, method: str) -> int:
        """How many `method` calls the server answered OK."""
        value = self.registry.get_sample_value(
            "pagedkv_rpc_total", {"service": SERVICE, "method": method, "code": "OK"})
        return int(value or 0)

    async def link(self, pool_id: str, register: bool = True, **shape: int | str) -> PoolLink:
        """A pool registered as a gateway's engine registers it (or not registered)."""
        executor = ExecutorClient("127.0.0.1:1")
        self.executors.append(executor)
        link = PoolLink(pool_id=pool_id, executor=executor, allocator=self.client,
                        lease=self.lease, description=description(**shape),  # type: ignore[arg-type]
                        enable_prefix_caching=True)
        if register:
            await link.register()
        return link

    async def match(self, prompt: list[int], pool_ids: list[str], salt: str = "") -> dict[str, int]:
        """The allocator's own answer: MatchPrefix's cached tokens per pool."""
        matches = await self.client.match_prefix(prompt, salt, pool_ids, "reference")
        return {m.pool_id: m.num_cached_tokens for m in matches}


async def cache(link: PoolLink, request_id: str, prompt: list[int], salt: str = "") -> None:
    """Prefill `prompt` in one step, commit all of it and free it: its full blocks stay cached
    (free, revivable) until evicted."""
    item = StepItem(request_id, len(prompt), tuple(prompt), salt)
    await link.step(StepCall(commits=(), free_request_ids=(), abort_request_ids=(),
                             items=(item,)))
    await link.free([Commit(request_id, len(prompt))], [request_id], 0)
