"""Test helpers: real presets with seeded random weights, transformers as the oracle.

`Driver` plays the gateway and the allocator for the runner: it hands out physical blocks in a
deliberately scattered order, sends block-table deltas, chunks prefills and feeds sampled
tokens back. The oracle is the same weights in transformers' own model with `sdpa` attention.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import llguidance
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.structured_output import StructuredOutput, grammar_text, load_tokenizer
from executor_svc.cpu_kernels import load as load_cpu_kernels
from executor_svc.runner import ModelRunner
from executor_svc.sampler import new_generator
from executor_svc.settings import ExecutorSettings
from executor_svc.step import (
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

MODELS = Path(__file__).resolve().parents[2] / "models"
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def make_settings(preset: str = "tiny-llama", **overrides: object) -> ExecutorSettings:
    base: dict[str, object] = {
        "model": str(MODELS / preset),
        "load_format": "dummy",
        "dtype": "float32",  # the references are float32 (tests/conftest.py)
        "seed": 1234,
        "block_size": 16,
        "num_blocks": 256,
        "swap_space": 1 / 1024,  # 1 MiB of CPU blocks
    }
    base.update(overrides)
    return ExecutorSettings(**base)  # type: ignore[arg-type]


def reference_model(runner: ModelRunner) -> PreTrainedModel:
    """transformers' own model (sdpa attention, dense cache) with the runner's weights."""
    config = AutoConfig.from_pretrained(MODELS / runner.info.model_name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.load_state_dict(runner.loaded.model.state_dict())
    model.generation_config.eos_token_id = None  # run every continuation to its full length
    model.generation_config.pad_token_id = 0
    return model


def reference_generate(model: PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    """Greedy continuation from model.generate, one prompt at a time (no padding effects)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             max_new_tokens=num_new, do_sample=False)
    continuation = out[0, len(prompt) :].tolist()
    assert len(continuation) == num_new
    return continuation


def reference_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """[T, V] on the model's device."""
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device), use_cache=False).logits[0]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties (transformers has none): over the tokens
    after the prompt, logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, presence: float, frequency: float, num_prompt_tokens: int) -> None:
        self.presence, self.frequency = presence, frequency
        self.num_prompt_tokens = num_prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.num_prompt_tokens :]  # [B, G]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )  # [B, V]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference_processors(params: SamplingParams, num_prompt_tokens: int) -> LogitsProcessorList:
    """transformers' processors in vLLM V1's order: min_tokens and logit_bias, penalties,
    then (sampling only) temperature, min_p, top_k, top_p."""
    processors = LogitsProcessorList()
    if params.min_tokens and params.stop_token_ids:
        processors.append(MinNewTokensLengthLogitsProcessor(
            num_prompt_tokens, params.min_tokens, list(params.stop_token_ids)))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(
            params.presence_penalty, params.frequency_penalty, num_prompt_tokens))
    if params.greedy:
        return processors
    processors.append(TemperatureLogitsWarper(params.temperature))
    if params.min_p:
        processors.append(MinPLogitsWarper(params.min_p))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors


def reference_sample(
    model: PreTrainedModel, tokens: list[int], params: SamplingParams, num_prompt_tokens: int,
    num_new: int,
) -> list[int]:
    """`num_new` tokens after `tokens` (whose first num_prompt_tokens are the prompt): a dense
    forward, transformers' processors, then argmax or a draw from the request's generator."""
    tokens = list(tokens)
    processors = reference_processors(params, num_prompt_tokens)
    # On the model's device, as the executor under test draws on its own.
    generator = new_generator(params.seed or 0, model.device)
    for _ in range(num_new):
        logits = reference_logits(model, tokens)[-1:].float()  # [1, V]
        scores = processors(torch.tensor([tokens], device=model.device), logits)[0]  # [V]
        if params.greedy:
            tokens.append(int(scores.argmax()))
        else:
            probs = torch.softmax(scores, dim=-1)  # [V]
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
    return tokens[len(tokens) - num_new :]


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@dataclass(slots=True)
class Driver:
    """A minimal gateway + allocator around a runner; blocks are handed out scattered."""

    runner: ModelRunner
    free_blocks: list[int] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # request id -> adapter

    @classmethod
    def scattered(cls, runner: ModelRunner, seed: int = 7) -> Driver:
        blocks = list(range(runner.info.num_blocks))
        random.Random(seed).shuffle(blocks)
        return cls(runner=runner, free_blocks=blocks)

    def work(
        self,
        rid: str,
        tokens: list[int],
        sample: bool,
        sampling: SamplingParams | None = None,
    ) -> SequenceWork:
        """One sequence's work: blocks for its new tokens are appended to its table."""
        held = self.num_tokens.get(rid, 0)
        table = self.tables.setdefault(rid, [])
        needed = -(-(held + len(tokens)) // self.runner.info.block_size) - len(table)
        new_blocks = [self.free_blocks.pop() for _ in range(max(needed, 0))]
        delta = BlockTableDelta(len(table), tuple(new_blocks)) if new_blocks else None
        table.extend(new_blocks)
        self.num_tokens[rid] = held + len(tokens)
        first = held == 0 and sampling is None
        sampling = SamplingParams() if first else sampling
        return SequenceWork(
            request_id=rid,
            token_ids=tuple(tokens),
            start_position=held,
            delta=delta,
            sampling=sampling,
            sample=sample,
            lora_adapter=self.lora_adapters.get(rid, "") if sampling is not None else "",
        )

    def generate(
        self, prompts: dict[str, list[int]], num_new: int, chunk: int | None = None
    ) -> dict[str, list[int]]:
        """Prefill all prompts (in chunks when given) in shared steps, then decode greedily."""
        outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
        offsets = dict.fromkeys(prompts, 0)
        while any(offsets[rid] < len(p) for rid, p in prompts.items()):
            seqs = []
            for rid, prompt in prompts.items():
                if offsets[rid] >= len(prompt):
                    continue
                end = len(prompt) if chunk is None else min(len(prompt), offsets[rid] + chunk)
                seqs.append(self.work(rid, prompt[offsets[rid] : end], sample=end == len(prompt)))
                offsets[rid] = end
            self._collect(StepRequest(seqs=tuple(seqs)), outputs)
        for _ in range(num_new - 1):
            seqs = [self.work(rid, [out[-1]], sample=True) for rid, out in outputs.items()]
            self._collect(StepRequest(seqs=tuple(seqs)), outputs)
        return outputs

    def _collect(self, step: StepRequest, outputs: dict[str, list[int]]) -> None:
        for token in self.runner.execute(step).tokens:
            outputs[token.request_id].append(token.token_id)


def built_kernels() -> ModuleType:
    """The executor's C++ CPU kernels. A test fails, never skips, where they did not build:
    `make setup` builds them on every machine this project supports."""
    module = load_cpu_kernels()
    assert module is not None, "the C++ kernels did not build: run `make setup` (see its log)"
    return module


def reference_constrained(
    next_logits: Callable[[list[int]], torch.Tensor], prompt: list[int], model_dir: str,
    vocab_size: int, eos_token_ids: tuple[int, ...], constraint: StructuredOutput,
    max_new: int,
) -> list[int]:
    """Greedy under a constraint: `next_logits(tokens)` ([V], the reference model's) masked
    by llguidance's byte-per-token mask (not the executor's bit path), to EOS or max_new."""
    lltok = load_tokenizer(model_dir, vocab_size, eos_token_ids)
    matcher = llguidance.LLMatcher(lltok, grammar_text(constraint, "reference"))
    tokens, out = list(prompt), []
    while len(out) < max_new and (not out or out[-1] not in eos_token_ids):
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        row = next_logits(tokens).float().clone()
        row[allowed[: row.shape[0]].to(row.device) == 0] = float("-inf")
        out.append(int(row.argmax()))
        tokens.append(out[-1])
        assert matcher.consume_token(out[-1]), matcher.get_error()
    return out

