"""Sampling options and request validation: a caller's mistake names the field to fix.

The servicer converts the proto into a `RawRequest` (unset optional fields are None) and
`validate` returns the checked `SamplingOptions`, or raises InvalidArgument /
ResourceExhausted with a message that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import InvalidArgument, ResourceExhausted

DEFAULT_MAX_TOKENS = 16
# Bounds on what one request may make the gateway hold or scan (and log): stop strings are
# matched at every token, ids and salts travel to the allocator and into every log line.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 128
MAX_CHAT_MESSAGES = 256  # each adds the template's own text around it


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


@dataclass(frozen=True, slots=True)
class RawSampling:
    """The client's sampling fields as sent (None: unset)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the model and the pools allow; fixed once the executors are known."""

    max_model_len: int
    vocab_size: int
    max_n: int
    pool_capacity_tokens: int  # the smallest pool, in tokens (num_blocks * block_size)


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


def validate_prompt(token_ids: list[int], limits: ModelLimits) -> None:
    if not token_ids:
        raise InvalidArgument("prompt is empty: send prompt text or prompt token_ids")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidArgument(
            f"prompt has {len(token_ids)} tokens; max_model_len is {limits.max_model_len} "
            "(prompt + completion): shorten the prompt"
        )
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
    n = raw.n or 1
    if n > limits.max_n:
        raise InvalidArgument(f"sampling.n is {n}; this gateway allows at most {limits.max_n}")
    bad = [t for t in raw.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"sampling.stop_token_ids contains {bad[0]}, outside the vocabulary "
            f"[0, {limits.vocab_size})"
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
    if max_tokens < 1:
        raise InvalidArgument(f"sampling.max_tokens is {max_tokens}; it must be >= 1")
    # Completions end at max_model_len (finish_reason length); the pool must hold one whole.
    needed = min(prompt_len + max_tokens, limits.max_model_len)
    if needed > limits.pool_capacity_tokens:
        raise ResourceExhausted(
            f"prompt ({prompt_len} tokens) + sampling.max_tokens ({max_tokens}) needs "
            f"{needed} tokens of KV cache; the smallest pool holds "
            f"{limits.pool_capacity_tokens}: lower max_tokens or shorten the prompt"
        )
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
    )
