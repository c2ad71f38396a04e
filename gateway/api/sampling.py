"""Sampling options and request validation: a caller's mistake names the field to fix.

The servicer converts the proto into a `RawRequest` (unset optional fields are None) and
`validate` returns the checked `SamplingOptions`, or raises InvalidArgument /
ResourceExhausted with a message that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import InvalidArgument, ResourceExhausted, Unimplemented
from common.structured_output import StructuredOutput, check_shape
from gateway.api.beam_options import check_beam
from gateway.api.sampling_fields import ModelLimits, RawSampling
from gateway.core.beam_search import BeamConfig

__all__ = ["ModelLimits", "RawSampling", "SamplingOptions", "validate"]

DEFAULT_MAX_TOKENS = 16
# Bounds on what one request may make the gateway hold or scan (and log): stop strings are
# matched at every token, ids and salts travel to the allocator and into every log line.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
# min_tokens masks every stop token: some token must be left to sample.
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 128
# LoRA requests' salts start with it and their adapter's digest (engine/adapters.py): a
# caller's salt may not, or a base-model request could read an adapter's KV.
ADAPTER_SALT_PREFIX = "lora:"
MAX_CHAT_MESSAGES = 256  # each adds the template's own text around it
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range
MAX_TOP_LOGPROBS = 20   # OpenAI's top_logprobs limit
MAX_PENALTY = 2.0       # presence/frequency, OpenAI's range
MAX_REPETITION_PENALTY = 100.0
MIN_REPETITION_PENALTY = 1e-6  # (smaller ones round to 0 in float32: read as off)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    n: int = 1
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely
    # None: none; k: each prompt token's logprob and rank, and the k most likely (the whole
    # prompt is computed: a cached prefix has no logits)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # lower first
    beam: BeamConfig | None = None  # use_beam_search (api/beam_options.py)
    # The output's constraint: its shape checked here, compiled by the frontend.
    structured_output: StructuredOutput | None = None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class ExceedsCapacity(ResourceExhausted):
    """The request can never fit a pool (unlike a full queue, retrying will not help)."""


def check_prompt_bytes(num_bytes: int, max_bytes: int, what: str = "prompt text") -> None:
    """Before tokenizing: a huge text would cost the tokenizer seconds and gigabytes."""
    if num_bytes > max_bytes:
        raise InvalidArgument(
            f"{what} is {num_bytes} bytes; this gateway accepts at most {max_bytes} "
            "(--max-prompt-bytes): shorten it"
        )


def check_ids(request_id: str, cache_salt: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
        )
    # It travels in x-request-id metadata to the other services: a header value.
    if not (request_id.isascii() and request_id.isprintable()):
        raise InvalidArgument(
            "request_id must be printable ASCII (it travels as the x-request-id header)"
        )
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(
            f"cache_salt has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}"
        )
    if cache_salt.startswith(ADAPTER_SALT_PREFIX):
        raise InvalidArgument(
            f"cache_salt may not start with {ADAPTER_SALT_PREFIX!r}: it is kept for LoRA "
            "adapters' own salts")


def check_prompt_fits(num_tokens: int, limits: ModelLimits, at_least: bool = False) -> None:
    """Room for the prompt and one token; `at_least`: a count known before tokenizing, the
    fewest tokens the text can be (text/token_bound.py)."""
    if num_tokens >= limits.max_model_len:
        raise InvalidArgument(
            f"prompt has {'at least ' if at_least else ''}{num_tokens} tokens; max_model_len "
            f"is {limits.max_model_len} (prompt + completion): shorten the prompt"
        )


# A priority travels to the allocator as an int32 (StepItem.priority): HTTP's integers must
# fit it too.
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


def validate_prompt(token_ids: list[int], limits: ModelLimits) -> None:
    if not token_ids:
        raise InvalidArgument("prompt is empty: send prompt text or prompt token_ids")
    check_prompt_fits(len(token_ids), limits)
    bad = next((t for t in token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"prompt token_ids contains {bad}, outside the vocabulary [0, {limits.vocab_size})"
        )


def validate(raw: RawSampling, prompt_len: int, limits: ModelLimits) -> SamplingOptions:
    """Check every field; the defaults of the public API apply to unset ones."""
    temperature = 1.0 if raw.temperature is None else raw.temperature
    if math.isnan(temperature) or temperature < 0:
        raise InvalidArgument(f"sampling.temperature is {temperature}; it must be >= 0")
    top_p = 1.0 if raw.top_p is None else raw.top_p
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p is {top_p}; it must be in (0, 1]")
    if not PRIORITY_RANGE[0] <= raw.priority <= PRIORITY_RANGE[1]:
        raise InvalidArgument(f"sampling.priority is {raw.priority}; it must be in "
                              f"{PRIORITY_RANGE[0]}..{PRIORITY_RANGE[1]}")
    n = raw.n or 1
    if n > limits.max_n:
        raise InvalidArgument(f"sampling.n is {n}; this gateway allows at most {limits.max_n}")
    bad = [t for t in raw.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"sampling.stop_token_ids contains {bad[0]}, outside the vocabulary "
            f"[0, {limits.vocab_size})"
        )
    most = min(MAX_STOP_TOKEN_IDS, limits.vocab_size - 1)
    if len(set(raw.stop_token_ids)) > most:
        raise InvalidArgument(
            f"sampling.stop_token_ids has {len(set(raw.stop_token_ids))} distinct ids; at most "
            f"{most}"
        )
    if len(raw.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop has {len(raw.stop)} strings; at most {MAX_STOP_STRINGS}"
        )
    if any(not s for s in raw.stop):
        raise InvalidArgument("sampling.stop contains an empty string: remove it")
    longest = max((len(s) for s in raw.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidArgument(
            f"sampling.stop has a string of {longest} characters; at most {MAX_STOP_CHARS}"
        )
    max_tokens = DEFAULT_MAX_TOKENS if raw.max_tokens is None else raw.max_tokens
    if raw.max_tokens is None and raw.fill_context:
        room = min(limits.max_model_len, limits.pool_capacity_tokens)
        max_tokens = max(room - prompt_len, 1)
    if max_tokens < 1:
        raise InvalidArgument(f"sampling.max_tokens is {max_tokens}; it must be >= 1")
    _check_processors(raw, limits.vocab_size)
    if raw.min_tokens > max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens is {raw.min_tokens}; it must be <= max_tokens ({max_tokens})"
        )
    # Completions end at max_model_len (finish_reason length); the pool must hold one whole.
    needed = min(prompt_len + max_tokens, limits.max_model_len)
    if needed > limits.pool_capacity_tokens:
        raise ExceedsCapacity(
            f"prompt ({prompt_len} tokens) + sampling.max_tokens ({max_tokens}) needs "
            f"{needed} tokens of KV cache; the smallest pool holds "
            f"{limits.pool_capacity_tokens}: lower max_tokens or shorten the prompt"
        )
    _check_structured_output(raw, limits)
    beam = check_beam(raw, limits, n, needed - prompt_len)
    if beam is not None:
        _check_beams_fit(beam, needed, limits)
        temperature = 0.0  # the executor's own pick is never used: the cheapest one
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=raw.top_k,
        seed=raw.seed,
        stop=raw.stop,
        stop_token_ids=frozenset(raw.stop_token_ids),
        n=n,
        ignore_eos=raw.ignore_eos,
        min_p=raw.min_p,
        presence_penalty=raw.presence_penalty,
        frequency_penalty=raw.frequency_penalty,
        repetition_penalty=1.0 if raw.repetition_penalty is None else raw.repetition_penalty,
        logit_bias=raw.logit_bias,
        min_tokens=raw.min_tokens,
        logprobs=raw.logprobs,
        prompt_logprobs=raw.prompt_logprobs,
        include_stop_str_in_output=raw.include_stop_str_in_output,
        skip_special_tokens=True if raw.skip_special_tokens is None else raw.skip_special_tokens,
        priority=raw.priority,
        beam=beam,
        structured_output=raw.structured_output,
    )


def _check_structured_output(raw: RawSampling, limits: ModelLimits) -> None:
    """What can be said before compiling: the executors apply it, and it can end."""
    constraint = raw.structured_output
    if constraint is None:
        return
    check_shape(constraint, "sampling.structured_output")
    if not limits.structured_output:
        raise Unimplemented(
            "sampling.structured_output: the executors behind this gateway do not apply "
            "structured output (Describe's structured_output; an executor needs the model's "
            "tokenizer.json): send the request without it")
    if raw.ignore_eos:
        raise InvalidArgument(
            "sampling.ignore_eos cannot go with structured_output: a complete output ends "
            "with EOS; drop one of them")


def _check_beams_fit(beam: BeamConfig, needed: int, limits: ModelLimits) -> None:
    """Every beam holding its own copy of every block (no sharing at all) must fit the
    smallest pool: a beam that waits for its siblings keeps its blocks meanwhile."""
    block = limits.block_size
    tokens = beam.beam_width * -(-needed // block) * block
    if tokens > limits.pool_capacity_tokens:
        raise ExceedsCapacity(
            f"beam search with beam_width {beam.beam_width} over {needed} tokens (prompt + "
            f"max_tokens) may hold {tokens} tokens of KV cache; the smallest pool holds "
            f"{limits.pool_capacity_tokens}: narrow the beam, lower max_tokens or shorten "
            "the prompt"
        )


def _in_range(name: str, value: float, low: float, high: float) -> None:
    if math.isnan(value) or not low <= value <= high:
        raise InvalidArgument(f"sampling.{name} is {value}; it must be in [{low}, {high}]")


def _check_processors(raw: RawSampling, vocab_size: int) -> None:
    """The logits processors' fields: OpenAI's ranges where OpenAI has the field."""
    _in_range("min_p", raw.min_p, 0.0, 1.0)
    _in_range("presence_penalty", raw.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _in_range("frequency_penalty", raw.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    if raw.repetition_penalty is not None:
        _in_range("repetition_penalty", raw.repetition_penalty, MIN_REPETITION_PENALTY,
                  MAX_REPETITION_PENALTY)
    if len(raw.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            f"sampling.logit_bias has {len(raw.logit_bias)} entries; at most "
            f"{MAX_LOGIT_BIAS_ENTRIES}"
        )
    for token_id, bias in raw.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(
                f"sampling.logit_bias has token id {token_id}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
        _in_range(f"logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if raw.min_tokens < 0:
        raise InvalidArgument(f"sampling.min_tokens is {raw.min_tokens}; it must be >= 0")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(raw, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"sampling.{name} is {value}; it must be in [0, {MAX_TOP_LOGPROBS}]")
