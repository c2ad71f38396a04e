"""Stop strings through the API (api/frontend.py, text/output.py) over an engine on its own
thread (engine/host.py) on the real allocator core and a fake model: the engine ends the
completion at the token that completes the match (core/finish_rules.py) and gives its blocks
back at once; the client's text is cut at the match, however that races with the client
leaving."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from test_engine import tokenizer as tokenizer  # the module-scoped fixture
from test_engine_host import _hosted, _stop

from gateway.api.frontend import Frontend, ModelInfo, PromptInput
from gateway.api.sampling import ModelLimits, RawSampling
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import CompletionDelta, FinishReason, Request
from gateway.engine.host import EngineHost
from gateway.text.tokenizer import Tokenizer

PROMPT = [9] * 6
DEPTHS = pytest.mark.parametrize("depth", [2, 1])


def _frontend(tokenizer: Tokenizer, host: EngineHost) -> Frontend:
    return Frontend(
        tokenizer=tokenizer,
        limits=ModelLimits(max_model_len=256, vocab_size=tokenizer.vocab_size, max_n=4,
                           pool_capacity_tokens=128),
        engines=host,
        info=ModelInfo("tiny", 256, tokenizer.vocab_size, (2,)),
    )


def _stop_string(tokenizer: Tokenizer, reference: list[int], span: int) -> tuple[int, str]:
    """(i, s): the text of tokens i-span+1..i, whose first match in the completion's text
    ends with token i (the fake model's tokens decode to one character each, or none)."""
    text = tokenizer.decode(reference)
    for i in range(span + 2, len(reference)):
        before = tokenizer.decode(reference[: i + 1 - span])
        upto = tokenizer.decode(reference[: i + 1])
        stop = upto[len(before):]
        if len(stop) == span and text.find(stop) == len(before):
            return i, stop
    raise AssertionError("no such stop string in the reference")


def _slow_executor(link: Any, delay_s: float) -> list[int]:
    """Each Execute of `link` takes `delay_s` more; returns its call counter ([count])."""
    original, calls = link.compute, [0]

    async def slow(call: Any) -> Any:
        calls[0] += 1
        await asyncio.sleep(delay_s)
        return await original(call)

    link.compute = slow
    return calls


async def _generate(frontend: Frontend, raw: RawSampling) -> tuple[Request, list[CompletionDelta]]:
    request = await frontend.submit(PromptInput(token_ids=PROMPT), raw, "", "")
    return request, [d async for d in frontend.deltas(request)]


async def _until_free(host: EngineHost, timeout_s: float = 2.0) -> float:
    """Seconds until the engine is idle and the pool has every block back."""
    eng = host.engines[0]
    link = eng.link
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not eng.busy and link.pool.all_free() and not link.model.held:  # type: ignore[attr-defined]
            return time.monotonic() - started
        await asyncio.sleep(0.005)
    raise AssertionError("blocks or executor state still held")


def _generate_until_free(host: EngineHost, task: Any, frontend: Frontend,
                         raw: RawSampling) -> tuple[list[CompletionDelta], float]:
    """One request's deltas, then the seconds until the engine gave everything back; the
    host is stopped either way."""
    async def scenario() -> tuple[list[CompletionDelta], float]:
        _, deltas = await _generate(frontend, raw)
        return deltas, await _until_free(host)

    try:
        return asyncio.run(scenario())
    finally:
        _stop(host, task)


@DEPTHS
@pytest.mark.parametrize("span", [1, 3])
def test_frontend_stop_string_ends_at_the_token_that_completes_it(
    tokenizer: Tokenizer, depth: int, span: int
):
    # A stop string of one token's text, or spanning three: the completion ends at the
    # token that completes it, with STOP, its usage counting that token, the text before
    # the match; the engine gives everything back.
    host, eng, link, task = _hosted(tokenizer, depth=depth)
    reference = link.model.reference(PROMPT, 24)
    stop_at, stop = _stop_string(tokenizer, reference, span)
    frontend = _frontend(tokenizer, host)

    deltas, _ = _generate_until_free(
        host, task, frontend, RawSampling(max_tokens=24, ignore_eos=True, stop=(stop,)))
    text = tokenizer.decode(reference)
    assert [t for d in deltas for t in d.token_ids] == reference[: stop_at + 1]
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == stop_at + 1
    assert not frontend.active


def test_frontend_the_engine_samples_nothing_after_the_stop(tokenizer: Tokenizer):
    # The client reads only once the engine is idle: it ended the completion at the stop
    # string (in the 5th token or so) by itself, not at its 40 tokens.
    host, eng, link, task = _hosted(tokenizer)
    reference = link.model.reference(PROMPT, 40)
    stop_at, stop = _stop_string(tokenizer, reference, 2)
    frontend = _frontend(tokenizer, host)

    async def scenario() -> tuple[Request, list[CompletionDelta]]:
        request = await frontend.submit(
            PromptInput(token_ids=PROMPT),
            RawSampling(max_tokens=40, ignore_eos=True, stop=(stop,)), "", "")
        await _until_free(host)  # the sequence finished at its stop string
        deltas = [d async for d in frontend.deltas(request)]
        await _until_free(host)
        return request, deltas

    try:
        request, deltas = asyncio.run(scenario())
    finally:
        _stop(host, task)
    assert [t for d in deltas for t in d.token_ids] == reference[: stop_at + 1]
    text = tokenizer.decode(reference)
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert request.outputs.empty()  # nothing was sampled after it


def test_frontend_stop_frees_the_blocks_of_a_long_completion(tokenizer: Tokenizer):
    # 100 tokens at 20 ms a step would take 2 s: the engine finishes the sequence at the
    # stop string in the first few and gives its blocks back at once.
    host, eng, link, task = _hosted(tokenizer)
    calls = _slow_executor(link, 0.02)
    reference = link.model.reference(PROMPT, 100)
    stop_at, stop = _stop_string(tokenizer, reference, 1)
    frontend = _frontend(tokenizer, host)

    deltas, freed_after_s = _generate_until_free(
        host, task, frontend, RawSampling(max_tokens=100, ignore_eos=True, stop=(stop,)))
    assert [t for d in deltas for t in d.token_ids] == reference[: stop_at + 1]
    assert freed_after_s < 0.5 and calls[0] < stop_at + 10


def test_frontend_client_leaving_after_one_completion_stopped_frees_both(
    tokenizer: Tokenizer,
):
    # n = 2: the client leaves on the first completion's stop; the request's cancellation
    # reaches an engine that finished that completion, maybe the other too: nothing leaks.
    host, eng, link, task = _hosted(tokenizer)
    _slow_executor(link, 0.005)
    reference = link.model.reference(PROMPT, 100)
    _, stop = _stop_string(tokenizer, reference, 2)
    frontend = _frontend(tokenizer, host)

    async def scenario() -> CompletionDelta:
        request = await frontend.submit(
            PromptInput(token_ids=PROMPT),
            RawSampling(max_tokens=100, ignore_eos=True, stop=(stop,), n=2), "", "")
        deltas = frontend.deltas(request)
        async for delta in deltas:
            if delta.finish_reason is not None:
                await deltas.aclose()  # the client goes, the other completion still open
                break
        await _until_free(host)
        return delta

    try:
        first = asyncio.run(scenario())
    finally:
        _stop(host, task)
    assert first.finish_reason is FinishReason.STOP
    assert not frontend.active


def test_frontend_cancels_what_the_engine_runs_on_after_the_text_ended(tokenizer: Tokenizer):
    # The engine's stop-string search fails (its tokenizer raises), the API's finds the
    # stop: the client still gets the text cut there, and the request is cancelled once the
    # text has ended, rather than run on to its 100 tokens.
    host, eng, link, task = _hosted(tokenizer)

    class Failing:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            raise ValueError("invalid prefix")

    eng.finish_rules = FinishRules(frozenset({2}), max_model_len=256, decoder=Failing())
    calls = _slow_executor(link, 0.02)
    reference = link.model.reference(PROMPT, 100)
    stop_at, stop = _stop_string(tokenizer, reference, 1)
    frontend = _frontend(tokenizer, host)

    deltas, _ = _generate_until_free(
        host, task, frontend, RawSampling(max_tokens=100, ignore_eos=True, stop=(stop,)))
    assert [t for d in deltas for t in d.token_ids] == reference[: stop_at + 1]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert calls[0] < stop_at + 10
