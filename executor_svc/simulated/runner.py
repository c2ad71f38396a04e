"""The simulated runner: ModelRunner's interface (runner_api.StepRunner), without a model.

A step: plan (plan.py, the real executor's validation: nothing changes when any part is
wrong) -> releases -> swap_out -> swap_in -> copies (each merged call's in turn:
merged_calls.py) -> "forward": each sequence reads the
digest before its first token from the slot cache through its block table, extends it by
its tokens and writes each one to its slot -> commit request state -> sample candidate 0 of
the token model -> sleep out the rest of the modelled step time. Greedy always: temperature,
seeds and the logits processors (penalties, logit_bias, min_tokens) are validated, not
applied.

NOTE: the sleep is in the servicer's compute thread, as a real step's compute is: a step
that arrives meanwhile waits in the worker's queue exactly as on a real executor, and the
thread blocks in the kernel (no CPU) while it waits. Not thread-safe: one step at a time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import structlog

from common.errors import ServiceError
from common.executor_description import ExecutorDescription
from executor_svc.held_requests import HeldRequests, num_accepted
from executor_svc.kv_transfer import SIMULATED_FORMAT, KVBlockStore, KVLayout
from executor_svc.merged_calls import only
from executor_svc.plan import Limits, PlannedSeq
from executor_svc.settings import SettingsError
from executor_svc.simulated.model_config import read_model_config
from executor_svc.simulated.profiles import PROFILES, Profile, StepShape
from executor_svc.simulated.settings import SimulatedSettings
from executor_svc.simulated.slot_cache import SlotBlocks, SlotCache
from executor_svc.simulated.token_model import ROOT_DIGEST, TokenModel, extend
from executor_svc.step import PromptLogprobs, SampledToken, StepRequest, StepResult, Timings

log = structlog.get_logger(__name__)
SIMULATED_BACKEND = "simulated"  # Describe's backend: the conformance suite keys on it


class SimulatedRunner(HeldRequests):
    def __init__(
        self,
        info: ExecutorDescription,
        limits: Limits,
        profile: Profile,
        time_scale: float,
        idle_release_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.info = info
        self.limits = limits
        self.profile = profile
        self.time_scale = time_scale
        self.tokens = TokenModel(info.vocab_size, frozenset(info.eos_token_ids))
        self.cache = SlotCache(limits.num_blocks, limits.num_cpu_blocks, limits.block_size)
        block_size = limits.block_size
        self.kv_blocks: KVBlockStore = SlotBlocks(
            self.cache,
            (lambda n: profile.transfer_ms(n, block_size) / 1e3 * time_scale) if time_scale
            else None)  # (slept by an import before it writes: not in the compute thread)
        self.sleep = sleep
        super().__init__(idle_release_s, clock)

    def execute(self, step: StepRequest) -> StepResult:
        """One call alone; its refusal raised."""
        return only(self.execute_merged((step,)))

    def execute_merged(self, steps: Sequence[StepRequest]) -> list[StepResult | ServiceError]:
        """Several callers' calls as one modelled step (merged_calls.py)."""
        start = time.perf_counter()
        merged = self.prepare(steps, self.cache)
        seqs = merged.seqs
        digests = [self._forward(planned) for planned in seqs]
        prompts = tuple(filter(None, (self._prompt_logprobs(planned) for planned in seqs)))
        self.commit(seqs)
        sample_start = time.perf_counter()
        tokens = self._sample(seqs, digests)
        sample_end = time.perf_counter()
        accepted = [s for s, o in zip(steps, merged.outcomes, strict=True)
                    if not isinstance(o, ServiceError)]
        shape = StepShape(
            num_tokens=sum(len(p.token_ids) for p in seqs),
            num_context_tokens=sum(p.work.start_position + len(p.token_ids) for p in seqs),
            num_swapped_blocks=sum(len(s.swap_out) + len(s.swap_in) for s in accepted),
        )
        modelled_s = self.profile.step_ms(shape, self.limits.block_size) / 1e3 * self.time_scale
        if (wait := start + modelled_s - time.perf_counter()) > 0:
            self.sleep(wait)
        end = time.perf_counter()
        sample_ms = (sample_end - sample_start) * 1e3
        total_ms = (end - start) * 1e3
        return merged.results(tokens, Timings(total_ms - sample_ms, sample_ms, total_ms),
                              prompts)

    def _forward(self, planned: PlannedSeq) -> int:
        """Write the sequence's digests to its slots; return its last one."""
        start, table, cache = planned.work.start_position, planned.block_table, self.cache
        digest = cache.read(table, start - 1) if start else ROOT_DIGEST
        for position, token_id in enumerate(planned.token_ids, start):
            digest = extend(digest, token_id, position)
            cache.write(table, position, digest)
        return digest

    def _prompt_logprobs(self, planned: PlannedSeq) -> PromptLogprobs | None:
        """The token model's log-probability of each prompt token this step predicts."""
        positions, prompt = planned.prompt_rows(), planned.prompt_token_ids
        if not positions or prompt is None:
            return None
        table, k = planned.block_table, planned.num_prompt_logprobs
        entries = [(self.tokens.token_logprob(self.cache.read(table, p), prompt[p + 1]),
                    self.tokens.top_logprobs(self.cache.read(table, p), k) if k else ())
                   for p in positions]
        return PromptLogprobs(planned.work.request_id, positions.start + 1,
                              tuple(lp for (lp, _), _ in entries),
                              tuple(rank for (_, rank), _ in entries),
                              tuple(top for _, top in entries))

    def _sample(self, seqs: tuple[PlannedSeq, ...], digests: list[int]) -> tuple[SampledToken, ...]:
        model, logprob, out = self.tokens, self.tokens.logprob(0), []
        for planned, digest in zip(seqs, digests, strict=True):
            if not planned.work.sample:
                continue
            state = self.requests[planned.work.request_id]
            token_id = model.next_token(digest)
            state.sampled_token = token_id  # a use_sampled_token row in the next step uses it
            k = state.sampling.top_logprobs
            top = model.top_logprobs(digest, k) if k else ()
            sampled = SampledToken(state.request_id, token_id, logprob, top)
            if planned.work.num_draft_tokens:
                sampled = self._verify(planned, sampled)
            out.append(sampled)
        return tuple(out)

    def _verify(self, planned: PlannedSeq, sampled: SampledToken) -> SampledToken:
        """Greedy verification: the token model's pick after each row, read back from the
        slots this step wrote (candidate 0, as sampling picks)."""
        work, k = planned.work, planned.work.num_draft_tokens
        rows = range(work.start_position, work.start_position + k)
        targets = [self.tokens.next_token(self.cache.read(planned.block_table, p)) for p in rows]
        accepted = num_accepted(planned.token_ids[-k:], targets)
        token_id = targets[accepted] if accepted < k else sampled.token_id
        return self.verified(sampled, k, accepted, token_id, sampled.logprob)


def build_simulated_runner(settings: SimulatedSettings) -> SimulatedRunner:
    """Describe's values from the model directory and the profile; no weights, no tensors."""
    profile = PROFILES[settings.simulate_profile]
    model = read_model_config(settings.model, profile.model.name)
    max_model_len = settings.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise SettingsError(f"--max-model-len {max_model_len} exceeds the model's limit "
                            f"{model.max_position_embeddings}; lower it")
    block_size = settings.block_size
    limits = Limits(
        num_blocks=settings.num_blocks or profile.num_blocks(block_size),
        num_cpu_blocks=(profile.num_cpu_blocks(block_size) if settings.num_cpu_blocks is None
                        else settings.num_cpu_blocks),
        block_size=block_size,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_draft_tokens=settings.max_draft_tokens,
    )
    info = ExecutorDescription(
        instance_id=uuid.uuid4().hex,
        model_name=model.name,
        model_fingerprint=model.fingerprint,
        num_blocks=limits.num_blocks,
        block_size=block_size,
        num_cpu_blocks=limits.num_cpu_blocks,
        dtype=profile.model.dtype,
        backend=SIMULATED_BACKEND,
        device=f"simulated:{profile.gpu.name}",
        max_model_len=max_model_len,
        eos_token_ids=model.eos_token_ids,
        vocab_size=model.vocab_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        role=settings.role,
        uses_sampled_tokens=True,
        max_draft_tokens=limits.max_draft_tokens,
        kv_layout=KVLayout(
            model_fingerprint=model.fingerprint, block_size=block_size,
            dtype=profile.model.dtype, num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            bytes_per_block=8 * block_size,  # one uint64 digest a slot
            format=SIMULATED_FORMAT,
        ),
    )
    return SimulatedRunner(info, limits, profile, settings.time_scale,
                           idle_release_s=settings.idle_release_s)
