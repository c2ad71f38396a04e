"""A known workload recorded through a real allocator server on loopback: the gateway's own
scheduler (depth 1) and allocator client drive it, the servicer's recorder writes it, and an
executor that samples known tokens takes STEP_S a step (the recorder's clock is the steps')."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.recording import Recorder, RecordingSettings
from allocator_svc.service import AllocatorServicer
from common.server import start_server
from gateway.api.sampling import SamplingOptions
from gateway.clients.allocator_client import AllocatorClient
from gateway.clients.executor_client import ExecutorClient
from gateway.clients.lease import Lease
from gateway.clients.pool_link import PoolLink
from gateway.core.batch import Budget
from gateway.core.request_state import Request, Sequence
from gateway.core.scheduler import Scheduler
from gateway.core.seq_ids import child_seq_id, prefill_parent_id
from gateway.core.step import ExecuteResult, Sampled
from pagedkv.allocator.v1 import allocator_pb2 as pb
from tests.gateway.loopback_allocator import SERVICE, description

STEP_S = 0.25  # a power of two: the replay's clock adds it up exactly
BLOCK_SIZE = 4
NUM_BLOCKS = 10
BUDGET = Budget(max_num_seqs=6, max_num_batched_tokens=12)
SHARED = [7, 7, 1, 2, 3, 4, 5, 6]  # two full blocks


@dataclass(frozen=True)
class Sent:
    request_id: str
    arrival_step: int
    prompt: list[int]
    num_outputs: tuple[int, ...]  # per completion (n > 1: several)
    aborted: bool = False


# Shared prefixes, a repeated prompt, chunked prefills, an n = 2 request, a cancelled one;
# the pool (80 tokens) is short enough to preempt.
WORKLOAD = [
    Sent("a", 0, SHARED + [11, 12, 13], (6,)),
    Sent("b", 0, SHARED + [21, 22], (9,)),
    Sent("c", 1, [31, 32, 33, 34, 35], (12,)),
    Sent("d", 2, SHARED + [11, 12, 13], (4,)),
    Sent("e", 2, SHARED + SHARED + [41], (10,)),
    Sent("f", 3, [51, 52, 53, 54, 55, 56], (5, 8)),
    Sent("g", 4, SHARED + [61], (7,), aborted=True),
    Sent("h", 6, [31, 32, 33, 34, 99, 98, 97], (11,)),
    Sent("i", 9, SHARED + [11, 12, 13], (3,)),
    Sent("j", 30, [71] * 13, (6,)),
]


def output_token(seq_id: str, position: int) -> int:
    return 1000 + (sum(map(ord, seq_id)) * 31 + position) % 5000


async def drive(path: Path, token_ids: bool = False) -> tuple[pb.PoolStats, int]:
    """The workload through a real server whose servicer records; the server's own stats,
    and the steps that ran."""
    clock = [0.0]
    allocator = Allocator(Limits())
    recorder = Recorder.open(RecordingSettings(str(path), token_ids), allocator.pools,
                             clock=lambda: clock[0])
    server = await start_server([(AllocatorServicer(allocator, recorder=recorder), SERVICE)],
                                "127.0.0.1", 0)
    client = AllocatorClient(f"127.0.0.1:{server.port}", timeout_s=5)
    lease = Lease(allocator=client, ttl_ms=60_000)
    await lease.acquire()
    executor = ExecutorClient("127.0.0.1:1")  # never called
    link = PoolLink("pool-0", executor, client, lease,
                    description(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), True)
    await link.register()
    scheduler = Scheduler(BUDGET, BLOCK_SIZE, clock=lambda: clock[0])
    wanted: dict[str, tuple[int, bool]] = {}
    forks: dict[str, Sent] = {}
    pending, steps = list(WORKLOAD), 0
    step = 0
    while True:
        clock[0] = step * STEP_S
        while pending and pending[0].arrival_step <= step:
            sent = pending.pop(0)
            request = Request(sent.request_id, sent.prompt, SamplingOptions(
                max_tokens=max(sent.num_outputs), n=len(sent.num_outputs), ignore_eos=True),
                "", arrival_time=clock[0], loop=None)
            if len(sent.num_outputs) == 1:
                seq = Sequence(seq_id=sent.request_id, request=request, index=0)
                wanted[seq.seq_id] = (sent.num_outputs[0], sent.aborted)
            else:
                seq = Sequence(seq_id=prefill_parent_id(sent.request_id), request=request,
                               index=0, is_prefill_parent=True)
                forks[seq.seq_id] = sent
            scheduler.add(seq)
        plan = scheduler.schedule()
        if plan is None:
            if not pending:
                break
            step = pending[0].arrival_step
            continue
        outcome = await link.step(plan.call)
        batch = scheduler.apply_outcome(plan, outcome)
        scheduler.pending.release_ids.clear()
        if batch.call.is_empty():
            if plan.call.has_items() and pending:
                step = max(step, pending[0].arrival_step)
            continue
        step += 1
        steps += 1
        call = batch.call
        result = ExecuteResult(
            tokens=tuple(Sampled(w.request_id, output_token(
                w.request_id, w.start_position + len(w.token_ids)))
                for w in call.seqs if w.sample),
            compute_ms=0.0,
            decode_token_ids=tuple(output_token(r, p + 1) for r, p in zip(
                call.decode_request_ids, call.decode_positions, strict=True)))
        for seq, _ in scheduler.apply_result(batch, result):
            num_outputs, aborted = wanted[seq.seq_id]
            if len(seq.output_token_ids) >= num_outputs:
                (scheduler.abort if aborted else scheduler.finish)(seq)
        for parent in scheduler.ready_to_fork(batch):
            sent = forks.pop(parent.seq_id)
            children = [Sequence(seq_id=child_seq_id(sent.request_id, i),
                                 request=parent.request, index=i)
                        for i in range(len(sent.num_outputs))]
            for child, num_outputs in zip(children, sent.num_outputs, strict=True):
                wanted[child.seq_id] = (num_outputs, False)
            tables = await link.fork(parent.seq_id, [c.seq_id for c in children],
                                     sent.request_id)
            scheduler.fork(parent, children, tables)
    stats = allocator.pools["pool-0"]
    assert not stats.requests, "the driver left requests at the allocator"
    pool_stats = pb.PoolStats(num_prefix_queries=stats.num_prefix_queries,
                              num_prefix_hits=stats.num_prefix_hits,
                              num_preemptions=stats.num_preemptions)
    recorder.close()
    await client.close()
    await executor.close()
    await server.server.stop(0)
    return pool_stats, steps
