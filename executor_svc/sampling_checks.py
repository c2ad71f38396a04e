"""A new request's sampling params and token history, checked against the model's limits.

Each bad value is the caller's mistake: InvalidArgument naming the field and the range to use.
Bounds are vLLM's where it has one (SamplingParams in executor.proto says what each means).
"""

from __future__ import annotations

import math

from common.errors import InvalidArgument
from executor_svc.step import SamplingParams, SequenceWork

# Sampling bounds (vLLM's, where it has one): see SamplingParams in executor.proto.
MAX_PENALTY = 2.0  # presence_penalty, frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 65536.0  # (0, 2^16]
MAX_LOGIT_BIAS = 100.0  # [-100, 100]
MAX_TOP_LOGPROBS = 20


def _in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def check_sampling(params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    if not (math.isfinite(params.temperature) and params.temperature >= 0.0):
        raise InvalidArgument(
            f"temperature {params.temperature} is out of range: use 0 (greedy) or a positive value"
        )
    if not (math.isfinite(params.top_p) and 0.0 < params.top_p <= 1.0):
        raise InvalidArgument(f"top_p {params.top_p} is out of range: use a value in (0, 1]")
    if params.top_k < 0:
        raise InvalidArgument(f"top_k {params.top_k} is out of range: use 0 (off) or a positive k")
    if not _in(params.min_p, 0.0, 1.0):
        raise InvalidArgument(f"min_p {params.min_p} is out of range: use a value in [0, 1]")
    for name, value in (("presence_penalty", params.presence_penalty),
                        ("frequency_penalty", params.frequency_penalty)):
        if not _in(value, -MAX_PENALTY, MAX_PENALTY):
            raise InvalidArgument(
                f"{name} {value} is out of range: use a value in "
                f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
            )
    penalty = params.repetition_penalty
    if not (_in(penalty, 0.0, MAX_REPETITION_PENALTY) and penalty > 0.0):
        raise InvalidArgument(
            f"repetition_penalty {penalty} is out of range: use a value in "
            f"(0, {MAX_REPETITION_PENALTY:g}] (1 or 0: off)"
        )
    _check_logit_bias(params, vocab_size)
    _check_stop_token_ids(params, vocab_size)
    if params.num_prompt_tokens > max_model_len:
        raise InvalidArgument(
            f"num_prompt_tokens {params.num_prompt_tokens} exceeds max_model_len="
            f"{max_model_len}; send the prompt's length"
        )
    most = min(MAX_TOP_LOGPROBS, vocab_size)
    for name, count in (("top_logprobs", params.top_logprobs),
                        ("prompt_logprobs", params.prompt_logprobs or 0)):
        if not 0 <= count <= most:
            raise InvalidArgument(f"{name} {count} is out of range: use a value in [0, {most}]")


def _check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    for token_id, bias in params.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(
                f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})"
            )
        if not _in(bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS):
            raise InvalidArgument(
                f"logit_bias: the bias {bias} of token {token_id} is out of range: use a value "
                f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )


def _check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(
            f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    if len(set(params.stop_token_ids)) >= vocab_size:
        raise InvalidArgument(
            f"stop_token_ids names all {vocab_size} tokens: min_tokens would leave none to "
            "sample; send the stop and EOS ids only"
        )


def check_history(work: SequenceWork, vocab_size: int) -> None:
    """history_token_ids: with a new request's sampling; when penalties are on and the
    request starts past 0, exactly the tokens before start_position."""
    rid, history = work.request_id, work.history_token_ids
    if history and work.sampling is None:
        raise InvalidArgument(
            f"request {rid!r}: history_token_ids on a request already held; send them only "
            "with its sampling params, on its first step"
        )
    if history and len(history) != work.start_position:
        raise InvalidArgument(
            f"request {rid!r}: history_token_ids has {len(history)} ids for start_position "
            f"{work.start_position}; send the tokens at positions [0, {work.start_position})"
        )
    _check_ids(rid, "history_token_ids", history, vocab_size)
    sampling = work.sampling
    if not history and sampling is not None and sampling.has_penalties and work.start_position:
        raise InvalidArgument(
            f"request {rid!r}: penalties are on and its first step starts at position "
            f"{work.start_position}: send history_token_ids (the {work.start_position} tokens "
            "before it), which the penalties count"
        )


def _check_ids(rid: str, name: str, ids: tuple[int, ...], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(
            f"request {rid!r}: {name}: token id {bad[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )


def check_prompt(work: SequenceWork, held_prompt: tuple[int, ...] | None, vocab_size: int) -> None:
    """prompt_token_ids: with a new request's prompt_logprobs only, the whole prompt; every
    step's tokens at prompt positions must be the prompt's (its logprobs are read from it)."""
    rid, prompt, sampling = work.request_id, work.prompt_token_ids, work.sampling
    if sampling is None and prompt:
        raise InvalidArgument(
            f"request {rid!r}: prompt_token_ids on a request already held; send them only "
            "with its sampling params, on its first step"
        )
    if sampling is not None:
        if sampling.prompt_logprobs is None:
            if prompt:
                raise InvalidArgument(
                    f"request {rid!r}: prompt_token_ids without sampling.prompt_logprobs; "
                    "send them only to ask for the prompt's logprobs"
                )
            return
        if not prompt:
            raise InvalidArgument(
                f"request {rid!r}: sampling.prompt_logprobs needs prompt_token_ids (the whole "
                "prompt)"
            )
        if len(prompt) != sampling.num_prompt_tokens:
            raise InvalidArgument(
                f"request {rid!r}: prompt_token_ids has {len(prompt)} ids for num_prompt_tokens "
                f"{sampling.num_prompt_tokens}; send the whole prompt"
            )
        _check_ids(rid, "prompt_token_ids", prompt, vocab_size)
        history = work.history_token_ids
        if history and tuple(history[: len(prompt)]) != prompt[: len(history)]:
            raise InvalidArgument(
                f"request {rid!r}: history_token_ids and prompt_token_ids disagree; send the "
                "same prompt in both"
            )
        held_prompt = prompt
    if held_prompt is None:
        return
    start = work.start_position
    if work.use_sampled_token and start < len(held_prompt):
        raise InvalidArgument(
            f"request {rid!r}: use_sampled_token at position {start}, inside its prompt_token_ids "
            "(its logprobs are read from the prompt): send the prompt's own token")
    sent = work.token_ids[: max(0, len(held_prompt) - start)]
    if sent and tuple(sent) != held_prompt[start : start + len(sent)]:
        raise InvalidArgument(
            f"request {rid!r}: token_ids at positions [{start}, {start + len(sent)}) are not "
            "its prompt_token_ids there; send the prompt's own tokens"
        )
