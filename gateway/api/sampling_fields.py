"""What validation reads: the client's sampling fields as sent, and the model's limits
(sampling.py checks them; beam_options.py checks beam search's share)."""

from __future__ import annotations

from dataclasses import dataclass

from common.structured_output import StructuredOutput
from gateway.core.beam_search import EarlyStopping


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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    priority: int = 0
    # Unset max_tokens: up to the end of the context (the chat API's default), not 16.
    fill_context: bool = False
    use_beam_search: bool = False
    beam_width: int | None = None  # unset: n
    length_penalty: float | None = None  # unset: 1.0
    early_stopping: EarlyStopping | None = None  # unset: HEURISTIC
    structured_output: StructuredOutput | None = None  # the output's constraint


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the model and the pools allow; fixed once the executors are known."""

    max_model_len: int
    vocab_size: int
    max_n: int
    pool_capacity_tokens: int  # the smallest pool, in tokens (num_blocks * block_size)
    max_beam_width: int = 8
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = 16  # the largest of the pools'
    structured_output: bool = False  # every executor applies structured output
