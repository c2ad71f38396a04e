"""Per-request sampling: greedy, temperature, min-p, top-k, top-p, seeded generators.

A row's logits go through, in vLLM V1's order: its LogitsProcessor (min_tokens, logit_bias,
penalties; only requests that use them have one), then, unless greedy, temperature, min_p,
top_k and top_p. Greedy takes the argmax after the processor.

The reported log-probability (and the top log-probabilities) are the raw distribution's: the
log-softmax of the logits before any processing, as vLLM reports by default. The sampled
token's is its logit less the row's log-sum-exp, taken with the raw argmax in one pass (a C++
kernel on CPU); a full log-softmax is computed only for the rows that ask for top
log-probabilities (and their sampled token's comes from it).
A request with a seed samples from its own generator with torch.multinomial, as transformers'
generate draws, so the same seed and the same logits reproduce the same tokens (and
transformers' own). The others share the executor's generator (seeded by --seed) and are drawn
together by inverse CDF, one uniform number a row: torch.multinomial draws an exponential for
every id of the vocabulary (~1 ms a row at 49k ids, 64 ms for a 64-row step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from executor_svc.grammar import mask_bias
from executor_svc.logits_processor import LogitsProcessor
from executor_svc.step import SamplingParams


def _apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)  # [V]
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))  # [V]


def _apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]  # scalar
    return logits.masked_fill(logits < kth, float("-inf"))  # [V]


def _apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)  # [V], [V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [V]
    # Drop a token when the tokens before it already reach top_p: the first one always stays.
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # [V]
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))  # [V]


# Vocabulary ids per chunk in `greedy_tokens`: small enough that the second pass is cheap.
ARGMAX_CHUNK = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S]
    """Each row's argmax, ties to the lowest id: exactly torch.argmax(logits, dim=-1).

    NOTE: on CPU, argmax over a 32,000-wide row runs element by element (1.7 ms at 64 rows)
    while amax is vectorised: so take each chunk's max, the first chunk that holds the row's
    max (it holds the row's first maximal id), then the argmax within that chunk (4x faster).
    """
    rows, vocab = logits.shape
    if vocab % ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)  # [S, V / C, C]
    best = chunks.amax(dim=-1).argmax(dim=-1)  # [S] first chunk holding the row's max
    within = chunks[torch.arange(rows, device=logits.device), best].argmax(dim=-1)  # [S]
    return best * ARGMAX_CHUNK + within


def argmax_and_lse(
    logits: torch.Tensor, kernel: ModuleType | None
) -> tuple[torch.Tensor, torch.Tensor]:  # [S, V] -> [S] long, [S] float32
    """Each row's first maximal id and its log-sum-exp (in float32).

    The CPU kernel reads the logits once, in their own dtype; elsewhere a float32 copy goes
    through greedy_tokens and torch.logsumexp.
    """
    if (
        kernel is not None
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
    ):
        ids, lse = kernel.argmax_logsumexp(logits)
        return ids, lse
    floats = logits.float()
    return greedy_tokens(floats), torch.logsumexp(floats, dim=-1)


def new_generator(seed: int, device: torch.device) -> torch.Generator:
    # manual_seed takes an unsigned 64-bit value; fold any Python int into that range.
    return torch.Generator(device=device).manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


@dataclass(frozen=True, slots=True)
class Samples:
    """One entry per row of logits."""

    token_ids: list[int]
    logprobs: list[float]  # raw log-softmax of each sampled token
    # SamplingParams.top_logprobs (token id, logprob) pairs per row, most likely first.
    top_logprobs: list[tuple[tuple[int, float], ...]]


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    """A row that does not sample greedily: temperature, then min_p, top_k, top_p (-inf out)."""
    return _filter(logits / params.temperature, params)


def _filter(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    """min_p, top_k, top_p on a temperature-scaled row (-inf out)."""
    filtered = _apply_top_k(_apply_min_p(scaled, params.min_p), params.top_k)
    return _apply_top_p(filtered, params.top_p)


def _draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:  # [V] -> scalar
    probs = torch.softmax(warp(logits, params), dim=-1)  # [V]
    return torch.multinomial(probs, 1, generator=generator)[0]


def draw_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generator: torch.Generator
) -> torch.Tensor:  # [R, V] float32 -> [R] long
    """One categorical draw per row, all rows at once: the first id whose cumulative
    probability passes a uniform number (one per row, from `generator`)."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                                device=logits.device)
    scaled = logits / temperatures[:, None]  # [R, V]
    for row, param in enumerate(params):  # only the rows that filter pay for it
        if param.min_p > 0.0 or param.top_k > 0 or param.top_p < 1.0:
            scaled[row] = _filter(scaled[row], param)
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)  # [R, V]
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # torch.multinomial refuses these too
        raise RuntimeError("a row to sample has no token of positive, finite probability")
    targets = torch.rand(len(params), 1, generator=generator, dtype=cdf.dtype,
                         device=cdf.device) * cdf[:, -1:]  # [R, 1] within each row's total
    # `right`: the first id whose cumulative sum exceeds the target, so never an id of
    # probability 0 (its sum equals the one before it).
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)


def top_logprobs(
    logits: torch.Tensor,  # [S, V] raw
    params: Sequence[SamplingParams],
    tokens: torch.Tensor,  # [S] the sampled tokens
    chosen: torch.Tensor,  # [S] their log-probabilities, rewritten for the asking rows
) -> list[tuple[tuple[int, float], ...]]:  # S tuples of (token id, logprob)
    """The top log-probabilities of the rows that ask; their sampled token's log-probability
    is taken from the same log-softmax, so it equals its entry there exactly."""
    counts = [p.top_logprobs for p in params]
    out: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    rows = [row for row, k in enumerate(counts) if k]
    if not rows:
        return out
    k = min(max(counts), logits.shape[-1])
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]: the asking rows only
    chosen[rows] = logprobs.gather(1, tokens[rows][:, None])[:, 0]
    values, ids = torch.topk(logprobs, k, dim=-1)  # [R, k], [R, k]
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        n = counts[row]
        out[row] = tuple(zip(row_ids[:n], row_values[:n], strict=True))
    return out


@dataclass(frozen=True, slots=True)
class EditedRows:
    """The rows that have a processor, processed in float32 copies (the raw rows stay)."""

    rows: list[int]  # rows of the logits, in order
    values: torch.Tensor  # [R, V] float32

    def source(self, logits: torch.Tensor, row: int) -> torch.Tensor:  # [V] float32
        """What a row samples from: its processed copy, or the raw row."""
        try:
            return self.values[self.rows.index(row)]
        except ValueError:
            return logits[row].float()


def _edited_rows(
    logits: torch.Tensor, processors: Sequence[LogitsProcessor | None]
) -> EditedRows | None:  # [S, V] -> None when no row has a processor
    """Each processed row in one gathered copy, then the constrained ones masked to what
    their structured output allows, with one add for all of them (a row at a time cost
    ~4 ms a step at 64 rows: bench/structured_output.py)."""
    rows = [row for row, processor in enumerate(processors) if processor is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    values = logits.index_select(0, index).float()  # [R, V] a copy in any dtype
    owned = [p for p in processors if p is not None]
    for value, processor in zip(values, owned, strict=True):
        processor.apply(value)
    constrained = [i for i, p in enumerate(owned) if p.grammar is not None]
    if not constrained:
        return EditedRows(rows, values)
    grammars = [owned[i].grammar for i in constrained]
    bias = mask_bias(grammars, logits.shape[-1], logits.device)  # type: ignore[arg-type]
    if len(constrained) == len(rows):
        values.add_(bias)
    else:
        values.index_add_(0, torch.tensor(constrained, device=logits.device), bias)
    for i, mask in zip(constrained, bias, strict=True):
        # min_tokens hid the EOS a complete output needs: the constraint wins.
        if owned[i].hides_stop_tokens and not bool(torch.isfinite(values[i]).any()):
            values[i] = logits[rows[i]].float() + mask
    return EditedRows(rows, values)


class Sampler:
    """Samples one token per row of logits; state is only the shared fallback generator."""

    def __init__(self, seed: int, device: torch.device, kernel: ModuleType | None = None) -> None:
        self._shared = new_generator(seed, device)
        self._kernel = kernel  # the CPU kernels (argmax_logsumexp), or None: torch

    def sample(
        self,
        logits: torch.Tensor,  # [S, V]
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        processors: Sequence[LogitsProcessor | None] = (),  # empty: none
    ) -> Samples:
        if logits.shape[0] == 0:
            return Samples([], [], [])
        # [S] the raw greedy choice (ties pick the lowest id) and each row's normaliser
        tokens, lse = argmax_and_lse(logits, self._kernel)
        edited = _edited_rows(logits, processors)
        if edited is not None:
            tokens[edited.rows] = greedy_tokens(edited.values)
        shared: list[int] = []  # drawn together from the executor's generator
        for row, (param, generator) in enumerate(zip(params, generators, strict=True)):
            if param.greedy:
                continue
            if generator is None:
                shared.append(row)
                continue
            source = edited.source(logits, row) if edited else logits[row].float()  # [V]
            tokens[row] = _draw(source, param, generator)
        if shared:
            rows = torch.stack([edited.source(logits, r) if edited else logits[r].float()
                                for r in shared])
            tokens[shared] = draw_rows(rows, [params[r] for r in shared], self._shared)
        chosen = logits.gather(1, tokens[:, None])[:, 0].float() - lse  # [S] raw log-softmax
        tops = top_logprobs(logits, params, tokens, chosen)
        return Samples(tokens.tolist(), chosen.tolist(), tops)
