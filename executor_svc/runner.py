"""The model runner: one Execute step, from a validated plan to sampled tokens.

A step: plan (validate everything; nothing changes on rejection) -> releases -> swap_out ->
swap_in -> copies (each call's in turn, when several callers' calls merge: merged_calls.py) ->
one forward pass over a packed [1, num_tokens] row with explicit
position_ids (each layer writes its new K/V before attending) -> commit request state ->
sample one token for each sequence whose prompt is complete.

Not thread-safe: the service runs one step at a time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import structlog
import torch

from common.errors import ServiceError
from common.executor_description import ExecutorDescription, LoraAdapterInfo
from executor_svc.attention import (
    AttentionBackend,
    SeqSpan,
    StepArrays,
    StepMetadata,
    make_backend,
)
from executor_svc.cpu_kernels import load as load_cpu_kernels
from executor_svc.grammar import GrammarCompiler, GrammarState, check_planned
from executor_svc.held_requests import HeldRequests, num_accepted
from executor_svc.kv_blocks import TorchKVBlocks
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.kv_transfer import TORCH_FORMAT, KVBlockStore, KVLayout
from executor_svc.logits_processor import LogitsProcessor
from executor_svc.lora import LoraSpec, PeftAdapter
from executor_svc.memory import count_blocks, forward_once
from executor_svc.merged_calls import MergedPlan, only
from executor_svc.model_loader import LoadedModel, ModelLoadError, dtype_name, load_model
from executor_svc.plan import Limits, PlannedSeq, RequestState
from executor_svc.prompt_logprobs import prompt_logprobs
from executor_svc.prompt_rows import PromptRows, RowLogits
from executor_svc.sampler import Sampler, new_generator
from executor_svc.settings import ExecutorSettings, SettingsError
from executor_svc.step import SampledToken, SequenceWork, StepRequest, StepResult, Timings

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [S, V]: one row per sequence that samples, in step order
    sampling_request_ids: tuple[str, ...]
    num_tokens: int
    # The logits of the rows predicting prompt tokens, in step order, by slice (prompt_rows.py);
    # None when no sequence asked.
    prompt_logits: RowLogits | None = None
    seqs: tuple[PlannedSeq, ...] = ()
    # Speculative decoding: the logits after each draft's predecessor row, [R, V], for the
    # sequences with drafts in step order (each its num_draft_tokens rows).
    draft_logits: torch.Tensor | None = None


class StepClock:
    """A step's forward and sampling times. On CUDA the forward's end is an event on the
    stream (the host runs ahead of the device), read once sampling has waited for it."""

    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._forward_end = self.start

    def forward_done(self) -> None:
        self._forward_end = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def timings(self) -> Timings:
        total_ms = (time.perf_counter() - self.start) * 1e3
        if self._events is not None:
            self._events[1].synchronize()
            forward_ms = self._events[0].elapsed_time(self._events[1])
        else:
            forward_ms = (self._forward_end - self.start) * 1e3
        forward_ms = min(forward_ms, total_ms)
        return Timings(forward_ms, total_ms - forward_ms, total_ms)


class ModelRunner(HeldRequests):
    def __init__(
        self,
        loaded: LoadedModel,
        cache: KVCache,
        backend: AttentionBackend,
        limits: Limits,
        seed: int,
        idle_release_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        num_cpu_cache_blocks: int = 0,
        role: str = "both",
        model_dir: str | None = None,
    ) -> None:
        self.loaded = loaded
        self.cache = cache
        self.kv_blocks: KVBlockStore = TorchKVBlocks(cache)
        self.backend = backend
        self.attention_shape = loaded.attention_shape
        self.limits = limits
        self.prompt_rows = PromptRows(loaded.model)
        self.sampler = Sampler(
            seed, loaded.device, load_cpu_kernels() if loaded.device.type == "cpu" else None
        )
        super().__init__(idle_release_s, clock)
        # model_dir: where structured output finds the tokenizer (none: it is refused)
        self.grammars = GrammarCompiler(model_dir, loaded.vocab_size, loaded.eos_token_ids)
        self.info = ExecutorDescription(
            instance_id=uuid.uuid4().hex,
            model_name=loaded.name,
            model_fingerprint=loaded.fingerprint,
            num_blocks=cache.num_blocks,
            block_size=limits.block_size,
            num_cpu_blocks=cache.num_cpu_blocks,
            dtype=dtype_name(loaded.dtype),
            backend=backend.name,
            device=str(loaded.device),
            max_model_len=limits.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            vocab_size=loaded.vocab_size,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_num_seqs=limits.max_num_seqs,
            num_cpu_cache_blocks=num_cpu_cache_blocks,
            role=role,
            uses_sampled_tokens=True,
            kv_layout=kv_layout(cache.spec, loaded.fingerprint),
            structured_output=self.grammars.available,
            max_draft_tokens=limits.max_draft_tokens,
        )
        self.adapters = loaded.adapters
        if self.adapters is not None:
            spec = self.adapters.spec
            self.info = replace(self.info, max_loras=spec.max_loras, max_lora_rank=spec.max_rank)

    def execute(self, step: StepRequest) -> StepResult:
        """One call alone; its refusal raised."""
        return only(self.execute_merged((step,)))

    def execute_merged(self, steps: Sequence[StepRequest]) -> list[StepResult | ServiceError]:
        """Several callers' calls in one forward (merged_calls.py); each call's result or
        refusal, in order."""
        clock = StepClock(self.loaded.device)
        merged, forward = self._prepare_and_forward(steps)
        clock.forward_done()
        tokens = self._sample(forward.sampling_request_ids, forward.logits)  # waits for it
        if forward.draft_logits is not None:
            tokens = self._verify(tokens, forward.seqs, forward.draft_logits)
        prompts = (() if forward.prompt_logits is None
                   else prompt_logprobs(forward.prompt_logits, forward.seqs))
        timings = clock.timings()
        log.debug(
            "step_executed",
            num_calls=len(steps),
            num_tokens=forward.num_tokens,
            num_sampled=len(tokens),
            forward_ms=round(timings.forward_ms, 3),
            total_ms=round(timings.total_ms, 3),
        )
        return merged.results(tokens, timings, prompts)

    def run_forward(self, step: StepRequest) -> ForwardOutput:
        """The step up to the logits (validate, apply, forward, commit); no sampling.

        `execute` adds sampling; tests call this to compare logits with transformers.
        """
        merged, forward = self._prepare_and_forward((step,))
        (outcome,) = merged.outcomes
        if isinstance(outcome, ServiceError):
            raise outcome
        return forward

    def _prepare_and_forward(self, steps: Sequence[StepRequest]
                             ) -> tuple[MergedPlan, ForwardOutput]:
        merged = self.prepare(steps, self.cache)
        seqs = merged.seqs
        if not seqs:
            empty = torch.empty(0, self.loaded.vocab_size, device=self.loaded.device)
            return merged, ForwardOutput(logits=empty, sampling_request_ids=(), num_tokens=0)
        logits, draft_logits, prompt_logits = self._forward(seqs)  # [S, V]
        self.commit(seqs)
        return merged, ForwardOutput(
            logits=logits,
            sampling_request_ids=tuple(p.work.request_id for p in seqs if p.work.sample),
            num_tokens=sum(len(p.token_ids) for p in seqs),
            prompt_logits=prompt_logits,
            seqs=seqs,
            draft_logits=draft_logits,
        )

    def _forward(self, seqs: tuple[PlannedSeq, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, RowLogits | None]:
        """Build the step's arrays on the host, plan attention, send the arrays in one copy,
        run the model: nothing here waits for the device. Returns each sampling row's
        logits, in step order, the rows before each draft's (None: no drafts), and those of
        the rows predicting prompt tokens (prompt_rows.py), when a sequence asked for them."""
        spans: list[SeqSpan] = []
        token_ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        draft_rows: list[int] = []
        prompt_rows: list[int] = []
        for planned in seqs:
            work = planned.work
            n = len(planned.token_ids)
            end = work.start_position + n
            first = len(token_ids)
            if work.num_draft_tokens:
                # Each row of a verified run attends as a decode row over the keys up to its
                # own (all are in the cache before attention): exact causal attention, on
                # every backend's decode path.
                spans.extend(SeqSpan(first + i, 1, work.start_position + i + 1,
                                     planned.block_table) for i in range(n))
                draft_rows.extend(range(first, first + work.num_draft_tokens))
            else:
                spans.append(SeqSpan(first, n, end, planned.block_table))
            positions.extend(range(work.start_position, end))
            token_ids.extend(planned.token_ids)
            if work.sample:
                keep.append(len(token_ids) - 1)
            if planned.prompt_token_ids is not None:
                predicting = planned.prompt_rows()
                offset = first - work.start_position
                prompt_rows.extend(range(predicting.start + offset, predicting.stop + offset))
        num_sampling = len(keep)
        keep.extend(draft_rows)
        num_kept = len(keep)
        by_hidden = bool(prompt_rows) and self.prompt_rows.enabled
        if prompt_rows and not by_hidden:
            keep.extend(prompt_rows)  # the model's own head scores them (prompt_rows.py)
        arrays = StepArrays(self.loaded.device)
        inputs = [arrays.add(values) for values in (token_ids, positions, keep)]  # [T], [T], [S]
        rows = arrays.add(prompt_rows) if by_hidden else None  # [P]
        metadata = StepMetadata.build(tuple(spans), self.limits.block_size, arrays)
        attention_step = self.backend.plan(metadata, self.cache, self.attention_shape)
        arrays.send()
        if by_hidden:
            self.prompt_rows.arm()
        if self.adapters is not None:
            self._arm_adapters(seqs)
        try:
            # The decoder's hook keeps the hidden state of prompt rows (prompt_rows.py).
            ids, step_positions, kept = (a.tensor for a in inputs)
            logits = forward_once(self.loaded, attention_step, ids, step_positions, kept,
                                  whole_model=by_hidden)
        finally:
            if self.adapters is not None:
                self.adapters.disarm()
        drafts = logits[num_sampling:num_kept] if draft_rows else None  # [R, V]
        if rows is not None:
            return logits[:num_sampling], drafts, self.prompt_rows.row_logits(rows.tensor)
        if not prompt_rows:
            return logits[:num_sampling], drafts, None
        kept = logits[num_kept:]  # [P, V]
        return logits[:num_sampling], drafts, lambda first, end: kept[first:end]

    def check_adapter(self, work: SequenceWork) -> None:
        if self.adapters is None:
            super().check_adapter(work)
            return
        self.adapters.check(work.lora_adapter, work.lora_adapter_digest)

    def read_lora_adapter(self, name: str, path: str) -> PeftAdapter:
        """Any thread: it reads files and the model's shapes only."""
        if self.adapters is None:
            return super().read_lora_adapter(name, path)
        return self.adapters.read(name, path)

    def install_lora_adapter(self, adapter: PeftAdapter) -> LoraAdapterInfo:
        assert self.adapters is not None, "read_lora_adapter refuses without LoRA"
        before = self.adapters.info()
        loaded = self.adapters.install(adapter)
        self._adapters_changed(before)
        return loaded

    def unload_lora_adapter(self, name: str) -> None:
        if self.adapters is None:
            super().unload_lora_adapter(name)
            return
        in_use = sum(state.lora_adapter == name for state in self.requests.values())
        before = self.adapters.info()
        self.adapters.remove(name, in_use)
        self._adapters_changed(before)

    def _adapters_changed(self, before: tuple[LoraAdapterInfo, ...]) -> None:
        assert self.adapters is not None
        now = self.adapters.info()
        if now != before:
            self.info = replace(self.info, lora_adapters=now,
                                lora_generation=self.info.lora_generation + 1)

    def _arm_adapters(self, seqs: tuple[PlannedSeq, ...]) -> None:
        """Each row's adapter slot for the forward (lora.py); none armed without adapter rows."""
        assert self.adapters is not None
        row_slots: list[int] = []
        for planned in seqs:
            name = (planned.work.lora_adapter if planned.is_new
                    else self.requests[planned.work.request_id].lora_adapter)
            row_slots.extend([self.adapters.slot_of(name)] * len(planned.token_ids))
        self.adapters.arm(row_slots, self.loaded.device)

    def new_state(self, work: SequenceWork) -> RequestState:
        """Its seeded generator and its logits processors, if it uses any."""
        state = super().new_state(work)
        seed = state.sampling.seed
        state.generator = None if seed is None else new_generator(seed, self.loaded.device)
        state.processor = self._processor(work)
        return state

    def check_constraint(self, planned: PlannedSeq) -> None:
        held = None if planned.is_new else self.requests[planned.work.request_id]
        check_planned(planned, held, self.grammars)

    def _processor(self, work: SequenceWork) -> LogitsProcessor | None:
        """A new request's processor, with the tokens before its first step in its history."""
        assert work.sampling is not None, "only a new request gets a processor"
        constraint = work.sampling.structured_output
        grammar = None if constraint is None else GrammarState(self.grammars.matcher(constraint))
        processor = LogitsProcessor.create(
            work.sampling, self.loaded.vocab_size, self.loaded.device, grammar
        )
        if processor is not None and work.history_token_ids:
            processor.append(work.history_token_ids, 0, sample=False)
        return processor

    def _sample(
        self, request_ids: tuple[str, ...], logits: torch.Tensor
    ) -> tuple[SampledToken, ...]:
        states = [self.requests[rid] for rid in request_ids]
        samples = self.sampler.sample(
            logits,
            [s.sampling for s in states],
            [s.generator for s in states],
            [s.processor for s in states],
        )
        for state, token_id in zip(states, samples.token_ids, strict=True):
            state.sampled_token = token_id  # a use_sampled_token row in the next step uses it
        return tuple(
            SampledToken(s.request_id, t, lp, top)
            for s, t, lp, top in zip(
                states, samples.token_ids, samples.logprobs, samples.top_logprobs, strict=True
            )
        )


    def _verify(self, tokens: tuple[SampledToken, ...], seqs: tuple[PlannedSeq, ...],
                draft_logits: torch.Tensor) -> tuple[SampledToken, ...]:
        """Greedy verification (plan.py admits drafts only under greedy sampling with nothing
        editing the logits): the drafts accepted while each equals its row's argmax; the
        token after them is the first mismatch's argmax, or the last row's sample."""
        targets = draft_logits.argmax(-1).tolist()
        by_id = {t.request_id: i for i, t in enumerate(tokens)}
        out, row = list(tokens), 0
        for planned in seqs:
            k = planned.work.num_draft_tokens
            if not k:
                continue
            drafts = planned.token_ids[-k:]
            accepted = num_accepted(drafts, targets[row:row + k])
            index = by_id[planned.work.request_id]
            sampled = out[index]
            token_id, logprob = sampled.token_id, sampled.logprob
            if accepted < k:
                token_id = targets[row + accepted]
                row_logits = draft_logits[row + accepted].float()
                logprob = float(torch.log_softmax(row_logits, -1)[token_id])
            out[index] = self.verified(sampled, k, accepted, token_id, logprob)
            row += k
        return tuple(out)


def kv_layout(spec: KVCacheSpec, model_fingerprint: str) -> KVLayout:
    """What one block is on the wire (kv_blocks.py): Describe's kv_layout."""
    return KVLayout(
        model_fingerprint=model_fingerprint,
        block_size=spec.block_size,
        dtype=dtype_name(spec.dtype),
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        bytes_per_block=spec.bytes_per_block,
        format=TORCH_FORMAT,
    )


def build_runner(settings: ExecutorSettings) -> ModelRunner:
    """Load the model, size and allocate the KV cache, pick the backend."""
    lora = (LoraSpec(settings.max_loras, settings.max_lora_rank) if settings.lora_enabled
            else None)
    loaded = load_model(
        settings.model, settings.load_format, settings.dtype, settings.device, settings.seed,
        lora=lora,
    )
    limit = loaded.max_position_embeddings
    window = getattr(loaded.config, "sliding_window", None)
    if window and getattr(loaded.config, "use_sliding_window", True):
        # NOTE: the paged backends attend to the whole context; capping the length at the
        # window makes a sliding-window model exact instead of silently different.
        limit = min(limit, int(window))
    max_model_len = settings.max_model_len or limit
    if max_model_len > limit:
        raise SettingsError(
            f"--max-model-len {max_model_len} exceeds the model's limit {limit}; lower it"
        )
    backend = make_backend(settings.backend, loaded.device)
    spec = KVCacheSpec.from_config(loaded.config, settings.block_size, loaded.dtype)
    num_blocks, num_cpu_blocks, num_cpu_cache_blocks = count_blocks(
        settings, loaded, spec, backend, max_model_len
    )
    cache = KVCache.allocate(spec, num_blocks, num_cpu_blocks, loaded.device)
    limits = Limits(
        num_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=settings.block_size,
        vocab_size=loaded.vocab_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_draft_tokens=settings.max_draft_tokens,
    )
    log.info(
        "kv_cache_allocated",
        num_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        num_cpu_cache_blocks=num_cpu_cache_blocks,
        block_size=settings.block_size,
        bytes_per_block=spec.bytes_per_block,
        max_model_len=max_model_len,
    )
    runner = ModelRunner(loaded, cache, backend, limits, settings.seed,
                         idle_release_s=settings.idle_release_s,
                         num_cpu_cache_blocks=num_cpu_cache_blocks, role=settings.role,
                         model_dir=settings.model)
    for name, path in settings.lora_modules:
        try:
            runner.load_lora_adapter(name, path)
        except ServiceError as exc:
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from None
    return runner
