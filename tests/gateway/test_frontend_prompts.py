"""Prompt text at the API's side (api/frontend.py): a prompt that cannot fit is refused before
it is tokenized, and short prompts never queue behind long ones on the tokenizer threads."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest

from common.errors import InvalidArgument
from common.model_dirs import DEFAULT_MODEL
from gateway.api.frontend import LONG_LANE_THREADS, SHORT_PROMPT_BYTES, Frontend, ModelInfo
from gateway.api.frontend import PromptInput as Prompt
from gateway.api.sampling import ModelLimits, RawSampling
from gateway.engine.host import EngineHost
from gateway.text.tokenizer import ChatTurn, Tokenizer

MAX_MODEL_LEN = 2048


@dataclass(slots=True)
class CountingHF:
    """The transformers tokenizer, recording the length of every text it is asked to encode;
    texts longer than `block_over` wait for `release` (a tokenization in progress)."""

    hf: Any
    lengths: list[int] = field(default_factory=list)
    block_over: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        with self.lock:
            self.lengths.append(len(text))
        if self.block_over is not None and len(text) > self.block_over:
            assert self.release.wait(10), "never released"
        return cast(list[int], self.hf.encode(text, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


@pytest.fixture(scope="module")
def real() -> Tokenizer:
    return Tokenizer.load(str(DEFAULT_MODEL))


def _frontend(tokenizer: Tokenizer, max_prompt_bytes: int = 64 << 20) -> Frontend:
    return Frontend(
        tokenizer=tokenizer,
        limits=ModelLimits(max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size,
                           max_n=4, pool_capacity_tokens=1 << 20),
        engines=cast(EngineHost, None),  # nothing here reaches an engine
        info=ModelInfo("smollm2", MAX_MODEL_LEN, tokenizer.vocab_size, (2,)),
        max_prompt_bytes=max_prompt_bytes,
    )


def _counting(real: Tokenizer, **kwargs: Any) -> tuple[Tokenizer, CountingHF]:
    counting = CountingHF(real.hf, **kwargs)
    return replace(real, hf=counting), counting


def test_frontend_refuses_a_prompt_of_many_mib_without_tokenizing_it(real: Tokenizer) -> None:
    # 32 MiB of text (under a raised --max-prompt-bytes) and a chat of 8 MiB: both refused
    # with the too-long prompt's INVALID_ARGUMENT; the tokenizer never saw either.
    tokenizer, counting = _counting(real)
    frontend = _frontend(tokenizer)

    async def scenario() -> None:
        with pytest.raises(InvalidArgument, match=r"prompt has at least \d+ tokens; "
                           r"max_model_len is 2048 \(prompt \+ completion\)"):
            await frontend.submit(Prompt(text="word " * (32 << 18)), RawSampling(), "", "")
        with pytest.raises(InvalidArgument, match="max_model_len is 2048"):
            await frontend.prompt_token_ids(Prompt(chat=[ChatTurn("user", "a" * (8 << 20))]))

    asyncio.run(scenario())
    frontend.close()
    assert counting.lengths == []
    assert frontend.tenant_seqs[""] == 0  # the refused request gave its slot back


def test_frontend_tokenizes_at_most_the_bound(real: Tokenizer) -> None:
    # Texts around the bound ((max_model_len - 1) x 81 bytes for SmolLM2): the tokenizer is
    # never asked for more than the bound, whatever is sent.
    assert real.bound is not None
    bound_bytes = (MAX_MODEL_LEN - 1) * real.bound.max_token_bytes
    tokenizer, counting = _counting(real)
    frontend = _frontend(tokenizer)

    async def scenario() -> None:
        for size in (bound_bytes - 1, bound_bytes, bound_bytes + 1, 10 * bound_bytes):
            try:
                await frontend.prompt_token_ids(Prompt(text="x" * size))
            except InvalidArgument as exc:
                assert "max_model_len is 2048" in str(exc)

    asyncio.run(scenario())
    frontend.close()
    assert counting.lengths and max(counting.lengths) <= bound_bytes


def test_frontend_short_prompt_is_served_while_long_ones_tokenize(real: Tokenizer) -> None:
    # Every long-lane thread busy with a long prompt (held mid-tokenization), and more
    # queued behind them: a 5-token prompt is tokenized meanwhile, before any long one ends.
    tokenizer, counting = _counting(real, block_over=SHORT_PROMPT_BYTES)
    frontend = _frontend(tokenizer)
    long_text = "a long prompt " * (SHORT_PROMPT_BYTES // 10)

    async def scenario() -> list[int]:
        longs = [asyncio.ensure_future(frontend.prompt_token_ids(Prompt(text=long_text)))
                 for _ in range(LONG_LANE_THREADS + 4)]
        while len(counting.lengths) < LONG_LANE_THREADS:
            await asyncio.sleep(0.01)  # the long lane's threads are all inside encode
        short = await frontend.prompt_token_ids(Prompt(text="The capital of France is"))
        assert not any(f.done() for f in longs)
        counting.release.set()
        await asyncio.gather(*longs)
        return short

    short = asyncio.run(scenario())
    frontend.close()
    assert short == real.encode("The capital of France is")
