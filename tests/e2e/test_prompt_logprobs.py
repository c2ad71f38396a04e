"""Prompt logprobs and `echo` through the whole stack, against transformers' forward: over
gRPC (sampling.prompt_logprobs), vLLM's `prompt_logprobs` and OpenAI's `echo` with logprobs
over HTTP, with a prompt whose prefix is cached, n > 1, and chunked prefills."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch
from e2e_stack import Clients, prompts, reference_prompt_rows, sampling, tokenizer

from pagedkv.gateway.v1 import gateway_pb2 as gpb

SERVED = "tiny-llama"


def _assert_matches(prompt: list[int], entries: list[tuple[int, float, int, list[int]]],
                    k: int) -> None:
    """(token id, logprob, rank, top ids) for prompt tokens 1.. against the reference."""
    rows = reference_prompt_rows(prompt)
    assert [e[0] for e in entries] == prompt[1:]
    got = torch.tensor([e[1] for e in entries])
    want = rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for (_, logprob, rank, top), row in zip(entries, rows, strict=True):
        fewest, most = (int((row > logprob + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert fewest <= rank <= most  # its rank, float noise allowed
        assert top == torch.topk(row, k).indices.tolist()


def _grpc_entries(completion: gpb.Completion) -> list[tuple[int, float, int, list[int]]]:
    return [(e.token_id, e.logprob, e.rank, [t.token_id for t in e.top_logprobs])
            for e in completion.prompt_logprobs]


@pytest.fixture(scope="module")
def client(tiny_stack: Clients) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_stack.http}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_grpc_prompt_logprobs_are_exact_in_chunks_past_a_cached_prefix(tiny_stack: Clients):
    # 600 tokens: three chunks of the 256-token budget. The same prompt first without them,
    # so that its blocks are cached: the request asking for them reads none (every row is
    # computed), and its own blocks stay cached for the request after it.
    prompt = next(prompts(1, 600, seed=901))
    ids = gpb.TokenIds(ids=prompt)
    stub = tiny_stack.gateway
    stub.Complete(gpb.CompleteRequest(token_ids=ids, sampling=sampling(2)))
    reply = stub.Complete(gpb.CompleteRequest(
        token_ids=ids, sampling=sampling(3, prompt_logprobs=2, n=2)))
    for completion in reply.completions:  # n = 2: both carry the prompt's
        _assert_matches(prompt, _grpc_entries(completion), 2)
        assert completion.usage.cached_prompt_tokens == 0
    again = stub.Complete(gpb.CompleteRequest(token_ids=ids, sampling=sampling(1)))
    assert again.completions[0].usage.cached_prompt_tokens >= 592
    assert list(again.completions[0].prompt_logprobs) == []
    streamed = list(stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt[:40]), sampling=sampling(4, prompt_logprobs=0))))
    assert len(streamed[0].prompt_logprobs) == 39  # on the first response only
    assert all(not r.prompt_logprobs for r in streamed[1:])
    _assert_matches(prompt[:40], [(e.token_id, e.logprob, e.rank, []) for e in
                                  streamed[0].prompt_logprobs], 0)
    tiny_stack.wait_all_blocks_back()


def test_echo_with_logprobs_scores_a_prompt_as_lm_eval_asks(client: openai.OpenAI,
                                                             tiny_stack: Clients):
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1.
    prompt = next(prompts(1, 30, seed=902))
    response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1,
                                         temperature=0, logprobs=1, echo=True)
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 31
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = reference_prompt_rows(prompt)
    want = rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:30]), want, atol=1e-4, rtol=0)
    text = tokenizer().decode
    for position, top in enumerate(lp.top_logprobs[1:30], 1):
        best = int(rows[position - 1].argmax())
        assert text([best]) in top and text([prompt[position]]) in top  # top 1 and its own
    assert choice.text.startswith(text(prompt))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Streamed: the echoed prompt and its logprobs come with the first chunk; the same text
    # and the same logprobs in all as in the whole response.
    chunks = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=3,
                                            temperature=0, echo=True, stream=True, logprobs=1))
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=3, temperature=0,
                                      echo=True, logprobs=1)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].text.startswith(text(prompt))
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    assert len(streamed) == 33 and streamed[0] is None
    tiny_stack.wait_all_blocks_back()


def test_vllm_prompt_logprobs_on_completions_and_chat(tiny_stack: Clients):
    prompt = next(prompts(1, 20, seed=903))
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}
    reply = httpx.post(f"{tiny_stack.http}/v1/completions", json=body, timeout=60).json()
    entries = reply["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 20
    rows = reference_prompt_rows(prompt)
    scored = []
    for token_id, entry, row in zip(prompt[1:], entries[1:], rows, strict=True):
        # The token's own entry and the most likely token's (one entry when they are one).
        best = int(row.argmax())
        assert set(entry) == {str(token_id), str(best)}
        assert entry[str(best)]["rank"] == 1
        assert entry[str(best)]["decoded_token"] == tokenizer().decode([best])
        own = entry[str(token_id)]
        scored.append((token_id, own["logprob"], own["rank"], [best]))
    _assert_matches(prompt, scored, 1)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = httpx.post(f"{tiny_stack.http}/v1/chat/completions", timeout=60, json={
        "model": SERVED, "messages": messages, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 0}).json()
    ids = httpx.post(f"{tiny_stack.http}/tokenize", timeout=60,
                     json={"messages": messages}).json()["tokens"]
    chat_entries = chat["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == len(ids)
    rows = reference_prompt_rows(ids)
    for position, entry in enumerate(chat_entries[1:], 1):
        value = entry[str(ids[position])]["logprob"]
        assert value == pytest.approx(rows[position - 1, ids[position]].item(), abs=1e-4)
    tiny_stack.wait_all_blocks_back()


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs is 21; it must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs is -1; it must be in [0, 20]"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not available with stream"),
    ({"prompt_logprobs": 1, "use_beam_search": True},
     "prompt_logprobs is not supported with use_beam_search"),
    ({"echo": 3}, "echo"),  # (and chat takes no echo: unknown fields are refused by name)
    ({"echo": True, "logprobs": 1, "prompt_logprobs": -5}, "prompt_logprobs is -5"),
])
def test_bad_prompt_logprobs_are_400s_naming_the_field(tiny_stack: Clients, body: dict,
                                                      message: str):
    for path, extra in (("completions", {"prompt": "Hello"}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        reply = httpx.post(f"{tiny_stack.http}/v1/{path}", timeout=60, json={
            "model": SERVED, "max_tokens": 2, **extra, **body})
        assert reply.status_code == 400, reply.text
        expected = "echo" if "echo" in body and path != "completions" else message
        assert expected in reply.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as failure:
        tiny_stack.gateway.Complete(gpb.CompleteRequest(
            text="Hello", sampling=sampling(2, prompt_logprobs=21)))
    assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs is 21" in failure.value.details()
    tiny_stack.wait_all_blocks_back()


def test_echo_logprobs_and_prompt_logprobs_each_keep_their_own_count(tiny_stack: Clients):
    # echo with logprobs 3 and vLLM's prompt_logprobs 0 in one request: the echoed prompt has
    # 3 top entries and its own; prompt_logprobs has each token's own entry alone.
    prompt = next(prompts(1, 12, seed=904))
    reply = httpx.post(f"{tiny_stack.http}/v1/completions", timeout=60, json={
        "model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 3, "prompt_logprobs": 0}).json()
    choice = reply["choices"][0]
    assert [list(e) for e in choice["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(3 <= len(top) <= 4 for top in tops[1:12])
    rows = reference_prompt_rows(prompt)
    for position, entry in enumerate(choice["prompt_logprobs"][1:], 1):
        value = entry[str(prompt[position])]["logprob"]
        assert value == pytest.approx(rows[position - 1, prompt[position]].item(), abs=1e-4)
        assert choice["logprobs"]["token_logprobs"][position] == pytest.approx(value, abs=1e-6)
    tiny_stack.wait_all_blocks_back()
