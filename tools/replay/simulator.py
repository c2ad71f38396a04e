"""One replay: a pool's recorded workload served at one configuration, by the gateway's own
scheduler (gateway/core/scheduler.py, plain Python) in front of the real allocator core, in
process, stepped as the gateway's engine steps (at --async-depth 2, step k+1 is planned and
allocated on top of batch k, which lands once k+1 is launched; at 1, each batch lands first).
The executor takes as long a step as the recorded pool did for as many requests and tokens
(step_time.py) and samples each request's recorded next token:

    requests join the queue at their recorded arrival (the clock: each step's time; an
        idle pool jumps to the next arrival)
    plan = scheduler.schedule()                      FCFS, max_num_seqs, max_num_batched_tokens,
                                                     chunked prefill
    result = allocator.step(plan)                    prefix cache, preemption from the tail
                                                     (recompute, or swap)
    batch = scheduler.apply_outcome(plan, result)    grants, preemptions, deferrals
    "execute" batch; scheduler.apply_result(...)     a request ends at its recorded length
                                                     (freed; aborted if it was); a computed
                                                     n > 1 prompt is forked into its children

Why the gateway's scheduler and not a small one: it is plain Python, cheap to drive (a few
hundred microseconds a step at a hundred running), and it is the policy the recorded run had:
decodes first, then prefill chunks, swapped-in, and new requests; a recompute preemption
readmits prompt and output at the queue front; nothing new in a step that preempted.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from allocator_svc.core.allocator import Allocator
from allocator_svc.core.limits import Limits
from allocator_svc.core.pool import PoolConfig
from allocator_svc.core.victims import PreemptionPolicy
from common.errors import ServiceError
from gateway.api.sampling import SamplingOptions
from gateway.core.batch import Batch, Budget
from gateway.core.request_state import Request, Sequence
from gateway.core.scheduler import Scheduler
from gateway.core.seq_ids import child_seq_id, prefill_parent_id
from gateway.core.step import ExecuteResult, Sampled, TableDelta
from tools.replay import core_link
from tools.replay.step_time import StepTime
from tools.replay.workload import Job, Output, ReplayError, Workload

POOL_ID = "replay"
MAX_IDLE_STEPS = 10_000  # steps that compute nothing in a row: the replay is stuck (a bug)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    num_blocks: int
    block_size: int
    preemption_mode: str = "recompute"  # or "swap"
    num_cpu_blocks: int = 0
    prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_time: StepTime = StepTime(0.02)
    async_depth: int = 2  # the gateway's --async-depth: 2 plans a step on top of the last
    num_cpu_cache_blocks: int = 0  # of num_cpu_blocks, the prefix cache's CPU tier
    preemption_policy: str = "tail"  # or "cost": the allocator's --preemption-policy


@dataclass(frozen=True, slots=True)
class ReplayResult:
    config: ReplayConfig
    num_requests: int
    num_steps: int  # batches executed
    sim_s: float  # simulated time from the first arrival to the last request's end
    peak_used_blocks: int
    sum_used_blocks: int  # over the steps
    num_prefix_queries: int  # prompt tokens at first admissions
    num_prefix_hits: int
    num_preemptions: int
    num_swap_outs: int
    wall_s: float
    completed: bool = True  # False: stopped at the first preemption (a search probe)

    @property
    def peak_utilization(self) -> float:
        return self.peak_used_blocks / self.config.num_blocks

    @property
    def mean_utilization(self) -> float:
        return self.sum_used_blocks / max(self.num_steps, 1) / self.config.num_blocks

    @property
    def hit_rate(self) -> float | None:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else None

    @property
    def steps_per_s(self) -> float:
        return self.num_steps / self.wall_s if self.wall_s > 0 else 0.0


def replay(workload: Workload, config: ReplayConfig,
           stop_at_first_preemption: bool = False) -> ReplayResult:
    """Serve `workload` at `config`; ReplayError (nothing run) for a configuration that
    cannot serve it."""
    workload.check_fits(config.num_blocks, config.block_size)
    started = time.perf_counter()
    enabled = gc.isenabled()
    gc.disable()  # the run makes much short-lived garbage and few cycles
    try:
        run = _Run(workload, config)
        run.serve(stop_at_first_preemption)
    finally:
        if enabled:
            gc.enable()
    pool = run.pool
    if run.completed:
        assert not pool.requests, f"replay ended with {len(pool.requests)} requests held"
    return ReplayResult(config, len(workload.jobs), run.num_steps, run.now - workload.start_s,
                        run.peak_used, run.sum_used, pool.num_prefix_queries,
                        pool.num_prefix_hits, pool.num_preemptions, pool.num_swap_outs,
                        time.perf_counter() - started, run.completed)


class _Run:
    def __init__(self, workload: Workload, config: ReplayConfig) -> None:
        self.workload, self.config = workload, config
        self.allocator = Allocator(Limits(
            max_blocks_per_pool=max(config.num_blocks, config.num_cpu_blocks, 1),
            max_cpu_blocks_per_pool=max(config.num_blocks, config.num_cpu_blocks, 1),
            max_batch_items=max(4096, config.max_num_seqs)),
            preemption_policy=PreemptionPolicy(config.preemption_policy))
        try:
            pool, _ = self.allocator.register_pool(PoolConfig(
                POOL_ID, config.num_blocks, config.block_size, config.num_cpu_blocks,
                "replay", "replay", config.prefix_caching, config.num_cpu_cache_blocks))
        except ServiceError as exc:
            raise ReplayError(f"the allocator refuses this pool: {exc}") from exc
        self.pool, self.epoch = pool, pool.epoch
        self.now = workload.start_s
        self.scheduler = Scheduler(
            Budget(config.max_num_seqs, config.max_num_batched_tokens), config.block_size,
            swap=config.preemption_mode == "swap", clock=lambda: self.now)
        self.outputs: dict[str, Output] = {}  # sequence id -> what it samples, when it ends
        self.forks: dict[str, Job] = {}  # prefill parent id -> its n > 1 request
        self.num_steps = self.peak_used = self.sum_used = 0
        self.completed = True

    def serve(self, stop_at_first_preemption: bool) -> None:
        """Step until every request has ended. At depth 2, step k+1 is planned and allocated
        on top of batch k, which lands after k+1 is launched (the engine's order)."""
        jobs, scheduler = self.workload.jobs, self.scheduler
        arrived = idle = 0
        in_flight: Batch | None = None
        while True:
            while arrived < len(jobs) and jobs[arrived].arrival_s <= self.now:
                self.arrive(jobs[arrived], arrived)
                arrived += 1
            plan = scheduler.schedule(in_flight is not None)
            if plan is None or not plan.call.has_items():
                landed, in_flight = in_flight, None
                if landed is not None:  # nothing to overlap it with: it lands first
                    self.land(landed)
                if plan is not None:  # frees and commits only
                    self.allocator.step(POOL_ID, self.epoch, None, plan.call)
                elif landed is None:
                    if arrived == len(jobs):
                        return
                    self.now = max(self.now, jobs[arrived].arrival_s)
                continue
            result = self.allocator.step(POOL_ID, self.epoch, None, plan.call)
            if in_flight is not None:
                scheduler.advance(in_flight)
            batch = scheduler.apply_outcome(plan, core_link.outcome(result,
                                                                    self.config.block_size))
            scheduler.pending.release_ids.clear()  # (no executor state to release)
            if stop_at_first_preemption and self.pool.num_preemptions:
                self.completed = False
                return
            if batch.call.is_empty():
                landed, in_flight = in_flight, None
                if landed is not None:
                    self.land(landed)
                idle += 1
                assert idle < MAX_IDLE_STEPS, "the replay computes nothing: stuck"
                if plan.call.has_items() and arrived < len(jobs):
                    self.now = max(self.now, jobs[arrived].arrival_s)
                continue
            idle = 0
            self.count(batch)
            scheduler.launch(batch)
            if in_flight is not None:
                self.land(in_flight)
            in_flight = batch
            if self.config.async_depth == 1:
                self.land(batch)
                in_flight = None

    def count(self, batch: Batch) -> None:
        """A batch executes: the pool's use now, and the step's time."""
        used = self.config.num_blocks - self.pool.blocks.num_free
        self.peak_used = max(self.peak_used, used)
        self.sum_used += used
        self.num_steps += 1
        scheduled = batch.scheduled
        self.now += self.config.step_time.seconds(len(scheduled), sum(n for _, n in scheduled))

    def arrive(self, job: Job, index: int) -> None:
        # FCFS by the recorded order (the scheduler breaks ties between a preempted request's
        # sequences and others by arrival time: the order, not the clock, must decide them).
        request_id = f"r{index}"
        request = Request(request_id, job.prompt, SamplingOptions(
            max_tokens=max(o.num_outputs for o in job.outputs), n=len(job.outputs),
            ignore_eos=True), "", arrival_time=float(index), loop=None)
        if len(job.outputs) == 1:
            seq = Sequence(seq_id=request_id, request=request, index=0)
            self.outputs[request_id] = job.outputs[0]
        else:
            seq = Sequence(seq_id=prefill_parent_id(request_id), request=request, index=0,
                           is_prefill_parent=True)
            self.forks[seq.seq_id] = job
        self.scheduler.add(seq)

    def land(self, batch: Batch) -> None:
        """Execute the batch (each token sampled is the recorded one), end what is done."""
        call, outputs = batch.call, self.outputs
        decoded = tuple(outputs[rid].token_at(position + 1) for rid, position
                        in zip(call.decode_request_ids, call.decode_positions, strict=True))
        sampled = tuple(Sampled(w.request_id,
                                outputs[w.request_id].token_at(w.start_position + len(w.token_ids)))
                        for w in call.seqs if w.sample)
        result = ExecuteResult(tokens=sampled, compute_ms=0.0, decode_token_ids=decoded)
        scheduler = self.scheduler
        for seq, _ in scheduler.apply_result(batch, result):
            output = outputs[seq.seq_id]
            if len(seq.output_token_ids) >= output.num_outputs:
                (scheduler.abort if output.aborted else scheduler.finish)(seq)
        for parent in scheduler.ready_to_fork(batch):
            self.fork(parent)

    def fork(self, parent: Sequence) -> None:
        job, request = self.forks.pop(parent.seq_id), parent.request
        children = [Sequence(seq_id=child_seq_id(request.request_id, i), request=request,
                             index=i, seed_offset=i) for i in range(len(job.outputs))]
        for child, output in zip(children, job.outputs, strict=True):
            self.outputs[child.seq_id] = output
        forked = self.allocator.fork(POOL_ID, self.epoch, parent.seq_id,
                                     [c.seq_id for c in children])
        self.scheduler.fork(parent, children, [
            TableDelta(0, tuple(b.block_id for b in c.blocks)) for c in forked])
