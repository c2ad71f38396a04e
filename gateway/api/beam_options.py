"""Beam search's request fields, checked: INVALID_ARGUMENT naming the field, or
RESOURCE_EXHAUSTED (ExceedsCapacity) for a search no pool could hold.

Beam search scores beams by the model's raw log-probabilities (transformers' beam search
without logits processors), so every field that would change the distribution or draw at
random is refused with it rather than ignored: temperature above 0, top_p, top_k, min_p,
seed, penalties, logit_bias, min_tokens; so are stop strings (a hypothesis ends at a stop
token: EOS or stop_token_ids) and logprobs. The beam width is bounded by
`--max-beam-width` and by the top log-probabilities an executor returns per token.
"""

from __future__ import annotations

import math

from common.errors import InvalidArgument
from gateway.api.sampling_fields import ModelLimits, RawSampling
from gateway.core.beam_search import BeamConfig, EarlyStopping

# The executors' limit on top log-probabilities per token (executor_svc/sampling_checks.py).
MAX_CANDIDATES = 20
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: len ** 10 stays finite for any context length
WIDTH_FIELD = "sampling.beam_width (best_of over HTTP)"


def check_beam(raw: RawSampling, limits: ModelLimits, n: int, max_tokens: int
               ) -> BeamConfig | None:
    """The request's beam search, or None without one."""
    if not raw.use_beam_search:
        # Their defaults are no-ops (vLLM's server sends them so): anything else is refused.
        defaults = {"beam_width": (None,), "length_penalty": (None, 1.0),
                    "early_stopping": (None, EarlyStopping.HEURISTIC)}
        for name, allowed in defaults.items():
            if getattr(raw, name) not in allowed:
                raise InvalidArgument(
                    f"sampling.{name} is set without use_beam_search: set use_beam_search "
                    "or leave it unset")
        return None
    width = n if raw.beam_width is None else raw.beam_width
    if not 1 <= width <= limits.max_beam_width:
        raise InvalidArgument(
            f"{WIDTH_FIELD} is {width}; it must be in [1, {limits.max_beam_width}] "
            "(--max-beam-width)")
    if n > width:
        raise InvalidArgument(
            f"sampling.n is {n}; beam search returns at most beam_width ({width}) hypotheses: "
            "lower n or widen the beam")
    _refuse_sampling_fields(raw)
    length_penalty = 1.0 if raw.length_penalty is None else raw.length_penalty
    if not (math.isfinite(length_penalty) and abs(length_penalty) <= MAX_LENGTH_PENALTY):
        raise InvalidArgument(
            f"sampling.length_penalty is {length_penalty}; it must be a finite number in "
            f"[-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")
    stops = frozenset(raw.stop_token_ids) | (
        frozenset() if raw.ignore_eos else frozenset(limits.eos_token_ids))
    config = BeamConfig(
        beam_width=width, num_return=n, max_tokens=max_tokens, stop_token_ids=stops,
        length_penalty=length_penalty,
        early_stopping=raw.early_stopping or EarlyStopping.HEURISTIC,
    )
    if config.num_candidates > MAX_CANDIDATES:
        per_beam = config.num_candidates // width
        raise InvalidArgument(
            f"{WIDTH_FIELD} is {width} with {len(stops)} stop tokens (EOS and "
            f"stop_token_ids): beam search needs the {config.num_candidates} most likely next "
            f"tokens of each beam and executors return at most {MAX_CANDIDATES}: use a "
            f"beam_width of at most {MAX_CANDIDATES // per_beam}, or fewer stop_token_ids")
    return config


def _refuse_sampling_fields(raw: RawSampling) -> None:
    """Fields beam search has no use for: refused by name, never ignored."""
    refused = {
        "temperature": raw.temperature not in (None, 0.0),
        "top_p": raw.top_p not in (None, 1.0),
        "top_k": raw.top_k != 0,
        "min_p": raw.min_p != 0.0,
        "seed": raw.seed is not None,
        "presence_penalty": raw.presence_penalty != 0.0,
        "frequency_penalty": raw.frequency_penalty != 0.0,
        "repetition_penalty": raw.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(raw.logit_bias),
        "min_tokens": raw.min_tokens != 0,
        "stop": bool(raw.stop),
        "logprobs": raw.logprobs is not None,
        "prompt_logprobs": raw.prompt_logprobs is not None,
        "structured_output": raw.structured_output is not None,
    }
    name = next((k for k, bad in refused.items() if bad), None)
    if name is not None:
        raise InvalidArgument(
            f"sampling.{name} is not supported with use_beam_search: beam search scores beams "
            "by the model's raw log-probabilities and ends them at stop tokens (EOS, "
            f"stop_token_ids); leave {name} unset")
