"""Describe, parity with the reference, copies, swaps and release: the executor contract."""

from __future__ import annotations

import random
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_svc.step import SamplingParams
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.executor.oracle import reference_sample

from .conftest import (
    Executor,
    Reference,
    reference_generate,
    reference_logprobs,
    require_model_logits,
    require_uses_sampled_tokens,
)

SERVICE = "pagedkv.executor.v1.ExecutorService"
pytestmark = pytest.mark.conformance


def _prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def _decode(executor: Executor, outputs: dict[str, list[int]], steps: int) -> None:
    for _ in range(steps):
        seqs = [executor.work(rid, [out[-1]]) for rid, out in outputs.items()]
        for token in executor.execute(*seqs).tokens:
            outputs[token.request_id].append(token.token_id)


def test_describe_reports_a_usable_executor(executor: Executor, reference: Reference) -> None:
    # Sizes, identity and limits are present and agree with the model's config.
    info = executor.info
    assert info.instance_id and info.model_name and info.model_fingerprint
    assert info.num_blocks > 0 and info.block_size > 0
    assert info.dtype in ("float32", "bfloat16", "float16")
    assert info.backend and info.device
    assert info.vocab_size == reference.config.vocab_size
    assert 0 < info.max_model_len <= reference.config.max_position_embeddings
    assert list(info.eos_token_ids), "EOS ids let the gateway stop requests"
    assert info.max_num_batched_tokens > 0 and info.max_num_seqs > 0
    again = executor.stub.Describe(pb.DescribeRequest())
    assert again.instance_id == info.instance_id, "instance_id changes only on restart"


def test_health_names_the_service_and_needs_no_credential(executor_addr: str) -> None:
    # The standard health service says SERVING to anyone (probes carry no credentials).
    # Reflection is optional: ours offers it only when it runs without authentication.
    with grpc.insecure_channel(executor_addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_prefill_and_decode_match_reference(executor: Executor, reference: Reference) -> None:
    # Three mixed-length prompts in one step, then 15 decode steps: greedy tokens equal the
    # reference's generate, and each prefill logprob equals the reference's log-softmax.
    prompts = _prompts(executor.info.vocab_size, [5, 23, 40], seed=1)
    rids = [f"parity-{i}" for i in range(3)]
    reply = executor.execute(*(executor.work(r, p) for r, p in zip(rids, prompts, strict=True)))
    assert reply.num_tokens == sum(map(len, prompts))
    assert [t.request_id for t in reply.tokens] == rids
    outputs = {t.request_id: [t.token_id] for t in reply.tokens}
    for token, prompt in zip(reply.tokens, prompts, strict=True):
        expected = reference_logprobs(reference, prompt)[-1, token.token_id].item()
        assert token.logprob == pytest.approx(expected, abs=1e-3)
    _decode(executor, outputs, 15)
    for rid, prompt in zip(rids, prompts, strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, 16), (
            f"{rid} diverged: are the reference weights the executor's "
            "(--reference-model / --reference-seed)?"
        )
    executor.forget(*rids)


def test_compact_decodes_match_reference(executor: Executor, reference: Reference) -> None:
    # Decodes in the compact columns (a sequence moves to `seqs` when it needs a new block):
    # the same greedy tokens as the reference, sampled tokens returned in column order.
    prompts = _prompts(executor.info.vocab_size, [7, 16, 30], seed=5)
    rids = [f"compact-{i}" for i in range(3)]
    reply = executor.execute(*(executor.work(r, p) for r, p in zip(rids, prompts, strict=True)))
    outputs = {t.request_id: [t.token_id] for t in reply.tokens}
    block_size = executor.info.block_size
    for _ in range(20):
        columns = [r for r in rids if executor.held[r] % block_size != 0]  # the table suffices
        seqs = [executor.work(r, [outputs[r][-1]]) for r in rids if r not in columns]
        request = pb.ExecuteRequest(
            seqs=seqs,
            decode_request_ids=columns,
            decode_token_ids=[outputs[r][-1] for r in columns],
            decode_positions=[executor.held[r] for r in columns],
        )
        for rid in columns:
            executor.held[rid] += 1
        reply = executor.stub.Execute(request)
        assert len(reply.decode_sampled_token_ids) == len(reply.decode_logprobs) == len(columns)
        assert [t.request_id for t in reply.tokens] == [s.request_id for s in seqs]
        for rid, token in zip(columns, reply.decode_sampled_token_ids, strict=True):
            outputs[rid].append(token)
        for token in reply.tokens:
            outputs[token.request_id].append(token.token_id)
    for rid, prompt in zip(rids, prompts, strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, 21), f"{rid} diverged"
    executor.forget(*rids)


def test_chunked_prefill_matches_reference(executor: Executor, reference: Reference) -> None:
    # A 50-token prompt in chunks of 13 (only the last samples), then 7 decode steps.
    prompt = _prompts(executor.info.vocab_size, [50], seed=2)[0]
    for start in range(0, 39, 13):
        reply = executor.execute(executor.work("chunked", prompt[start : start + 13], sample=False))
        assert list(reply.tokens) == []
    reply = executor.execute(executor.work("chunked", prompt[39:]))
    outputs = {"chunked": [reply.tokens[0].token_id]}
    _decode(executor, outputs, 7)
    assert outputs["chunked"] == reference_generate(reference, prompt, 8)
    executor.forget("chunked")


def test_copy_on_write_fork_matches_reference(
    executor: Executor, reference: Reference
) -> None:
    # A child forks a parent mid-block: shares its full blocks, gets a copy of the partial one.
    size = executor.info.block_size
    prompt = _prompts(executor.info.vocab_size, [size + size // 2 + 1], seed=3)[0]
    first = executor.execute(executor.work("parent", prompt)).tokens[0].token_id
    *shared, partial = executor.tables["parent"]
    (copy_dst,) = executor.blocks.take(1)
    child = pb.SequenceWork(
        request_id="child",
        sampling=pb.SamplingParams(),
        token_ids=[first],
        start_position=len(prompt),
        delta=pb.BlockTableDelta(start_index=0, block_ids=[*shared, copy_dst]),
        sample=True,
    )
    executor.tables["child"], executor.held["child"] = [copy_dst], len(prompt) + 1
    reply = executor.execute(
        executor.work("parent", [first]),
        child,
        copies=[pb.BlockCopy(src_block_id=partial, dst_block_id=copy_dst)],
    )
    outputs = {t.request_id: [first, t.token_id] for t in reply.tokens}
    executor.tables["child"] = [*shared, copy_dst]
    _decode(executor, outputs, 6)
    expected = reference_generate(reference, prompt, 8)
    assert outputs == {"parent": expected, "child": expected}
    executor.tables["child"] = [copy_dst]  # the shared blocks go back once, with the parent
    executor.forget("parent", "child")


def test_swap_out_and_in_matches_reference(executor: Executor, reference: Reference) -> None:
    # Swap a request's blocks to CPU, let another request overwrite them, swap them back into
    # other blocks (table replaced by the delta), and continue like the reference.
    size = executor.info.block_size
    prompt = _prompts(executor.info.vocab_size, [2 * size + 3], seed=4)[0]
    outputs = {"swapped": [executor.execute(executor.work("swapped", prompt)).tokens[0].token_id]}
    _decode(executor, outputs, 2)
    old = executor.tables["swapped"]
    if executor.info.num_cpu_blocks < len(old):
        pytest.skip(
            f"the executor reports {executor.info.num_cpu_blocks} CPU blocks; need {len(old)}"
        )
    cpu = executor.blocks.take_cpu(len(old))
    executor.execute(
        swap_out=[
            pb.BlockCopy(src_block_id=g, dst_block_id=c) for g, c in zip(old, cpu, strict=True)
        ]
    )
    executor.blocks.free.extend(old)
    intruder = _prompts(executor.info.vocab_size, [len(old) * size], seed=5)[0]
    executor.execute(executor.work("intruder", intruder, sample=False))
    new = executor.blocks.take(len(old))
    resume = pb.SequenceWork(
        request_id="swapped",
        token_ids=[outputs["swapped"][-1]],
        start_position=executor.held["swapped"],
        delta=pb.BlockTableDelta(start_index=0, block_ids=new),
        sample=True,
    )
    reply = executor.execute(
        resume,
        release_request_ids=["intruder"],
        swap_in=[
            pb.BlockCopy(src_block_id=c, dst_block_id=g) for c, g in zip(cpu, new, strict=True)
        ],
    )
    executor.blocks.free.extend(executor.tables.pop("intruder"))
    executor.held.pop("intruder")
    executor.tables["swapped"], executor.held["swapped"] = new, executor.held["swapped"] + 1
    executor.blocks.free_cpu.extend(cpu)
    outputs["swapped"].append(reply.tokens[0].token_id)
    _decode(executor, outputs, 3)
    assert outputs["swapped"] == reference_generate(reference, prompt, 7)
    executor.forget("swapped")


def test_release_drops_request_state(executor: Executor) -> None:
    # Released ids are unknown afterwards (NOT_FOUND); Release counts only held ids.
    vocab = executor.info.vocab_size
    a, b = _prompts(vocab, [4, 4], seed=6)
    executor.execute(executor.work("rel-a", a), executor.work("rel-b", b))
    executor.execute(release_request_ids=["rel-a"])
    reply = executor.stub.Release(pb.ReleaseRequest(request_ids=["rel-a", "rel-b", "never-seen"]))
    assert reply.num_released == 1
    for rid in ("rel-a", "rel-b"):
        work = pb.SequenceWork(request_id=rid, token_ids=[5], start_position=4, sample=True)
        with pytest.raises(grpc.RpcError) as err:
            executor.execute(work)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    executor.forget("rel-a", "rel-b")


def test_sampling_with_a_seed_reproduces(executor: Executor) -> None:
    # The same seeded request twice gives the same tokens and finite logprobs.
    prompt = _prompts(executor.info.vocab_size, [9], seed=7)[0]
    runs = []
    for rid in ("seeded-1", "seeded-2"):
        reply = executor.execute(
            executor.work(rid, prompt, temperature=1.0, top_p=0.9, top_k=40, seed=1234)
        )
        outputs = {rid: [reply.tokens[0].token_id]}
        assert torch.isfinite(torch.tensor(reply.tokens[0].logprob))
        _decode(executor, outputs, 5)
        runs.append(outputs[rid])
        executor.forget(rid)
    assert runs[0] == runs[1]


def test_sampled_tokens_are_used_before_they_return(
    executor: Executor, reference: Reference
) -> None:
    # Each decode step goes out before the one before it has returned (two calls in flight),
    # its tokens standing for the ones that step samples: compact rows with
    # decode_use_sampled_token, and SequenceWork with use_sampled_token when a sequence needs a
    # new block. The tokens equal the reference's generate.
    require_uses_sampled_tokens(executor)
    prompts = _prompts(executor.info.vocab_size, [6, 15, 29], seed=8)
    rids = [f"ahead-{i}" for i in range(3)]
    block_size = executor.info.block_size
    prefill = [executor.work(r, p) for r, p in zip(rids, prompts, strict=True)]
    # gRPC does not order two calls in flight: each step names the one it builds on, as a
    # gateway does (ids unlike any other caller's).
    base_id = time.time_ns()
    calls = [([], executor.stub.Execute.future(pb.ExecuteRequest(seqs=prefill,
                                                                  step_id=base_id)))]
    for step in range(20):
        columns = [r for r in rids if executor.held[r] % block_size != 0]
        seqs = [executor.work(r, [0]) for r in rids if r not in columns]
        for work in seqs:
            work.use_sampled_token = True
        request = pb.ExecuteRequest(
            seqs=seqs, decode_request_ids=columns, decode_token_ids=[0] * len(columns),
            decode_positions=[executor.held[r] for r in columns],
            decode_use_sampled_token=[True] * len(columns),
            step_id=base_id + step + 1, previous_step_id=base_id + step,
        )
        for rid in columns:
            executor.held[rid] += 1
        calls.append((columns, executor.stub.Execute.future(request)))
        calls[step][1].result()  # the one before returns only now: two are in flight
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    for columns, call in calls:
        reply = call.result()
        for rid, token in zip(columns, reply.decode_sampled_token_ids, strict=True):
            outputs[rid].append(token)
        for token in reply.tokens:
            outputs[token.request_id].append(token.token_id)
    executor.forget(*rids)
    for rid, prompt in zip(rids, prompts, strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, 21), f"{rid} diverged"


def test_use_sampled_token_needs_a_token_sampled_by_the_last_step(
    executor: Executor, reference: Reference
) -> None:
    # FAILED_PRECONDITION, changing nothing, where the request's last step sampled nothing:
    # a new request, after a prefill chunk, after a step that did not sample. Between them
    # the request goes on like the reference.
    require_uses_sampled_tokens(executor)
    prompt = _prompts(executor.info.vocab_size, [12], seed=9)[0]

    def use_sampled(rid: str) -> pb.SequenceWork:
        work = executor.work(rid, [0])
        work.use_sampled_token = True
        return work

    def rejected(rid: str) -> None:
        held = executor.held.get(rid, 0)
        with pytest.raises(grpc.RpcError) as err:
            executor.execute(use_sampled(rid))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "use_sampled_token" in (err.value.details() or "")
        executor.held[rid] = held  # work() counted the token the executor refused

    rejected("used-new")
    executor.forget("used-new")
    executor.execute(executor.work("used", prompt[:8], sample=False))  # a chunk
    rejected("used")
    outputs = [executor.execute(executor.work("used", prompt[8:])).tokens[0].token_id]
    outputs.append(executor.execute(use_sampled("used")).tokens[0].token_id)
    executor.execute(executor.work("used", [outputs[-1]], sample=False))  # no sample
    rejected("used")
    executor.forget("used")
    assert outputs == reference_generate(reference, prompt, 2)


def test_a_step_naming_its_previous_step_waits_for_it(
    executor: Executor, reference: Reference
) -> None:
    # gRPC does not order two calls: the second step, which builds on the first's sampled
    # token, is sent first. Naming the first (previous_step_id), it waits for it and runs
    # after it; both give the reference's tokens.
    require_uses_sampled_tokens(executor)
    prompt = _prompts(executor.info.vocab_size, [10], seed=10)[0]
    first_id = time.time_ns()  # ids unlike any another caller sent this executor
    first = pb.ExecuteRequest(seqs=[executor.work("order", prompt)], step_id=first_id)
    second_work = executor.work("order", [0])
    second_work.use_sampled_token = True
    second = pb.ExecuteRequest(seqs=[second_work], step_id=first_id + 1,
                               previous_step_id=first_id)
    second_call = executor.stub.Execute.future(second, timeout=30)
    time.sleep(0.2)
    assert not second_call.done(), "the second step ran before the one it names arrived"
    first_reply = executor.stub.Execute(first, timeout=30)
    tokens = [first_reply.tokens[0].token_id, second_call.result().tokens[0].token_id]
    executor.forget("order")
    assert tokens == reference_generate(reference, prompt, 2)


# Penalties, logit_bias and min_tokens, in values a float32 field holds exactly.
PENALISED: dict[str, object] = {
    "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.75,
    "logit_bias": {7: 2.0, 8: -3.0},
}


def _reference_params(fields: dict[str, object]) -> SamplingParams:
    bias = fields.get("logit_bias", {})
    assert isinstance(bias, dict)
    others = {k: v for k, v in fields.items() if k not in ("logit_bias", "stop_token_ids")}
    return SamplingParams(logit_bias=tuple(sorted(bias.items())),
                          stop_token_ids=tuple(fields.get("stop_token_ids", ())),  # type: ignore[arg-type]
                          **others)  # type: ignore[arg-type]


def test_penalties_bias_and_min_tokens_match_reference(
    executor: Executor, reference: Reference
) -> None:
    # A greedy request with penalties, a logit bias and min_tokens masking its first greedy
    # token decodes (in the compact columns where its table suffices) exactly as a loop over
    # transformers' processors in vLLM's order.
    require_model_logits(executor)
    prompt = _prompts(executor.info.vocab_size, [20], seed=11)[0]
    first = reference_generate(reference, prompt, 1)[0]
    fields = {**PENALISED, "min_tokens": 4, "stop_token_ids": [first, 2],
              "num_prompt_tokens": len(prompt)}
    outputs = {"penalised": [executor.execute(
        executor.work("penalised", prompt, **fields)).tokens[0].token_id]}  # type: ignore[arg-type]
    for _ in range(11):
        if executor.held["penalised"] % executor.info.block_size == 0:
            _decode(executor, outputs, 1)
            continue
        reply = executor.stub.Execute(pb.ExecuteRequest(
            decode_request_ids=["penalised"], decode_token_ids=[outputs["penalised"][-1]],
            decode_positions=[executor.held["penalised"]]))
        executor.held["penalised"] += 1
        outputs["penalised"].append(reply.decode_sampled_token_ids[0])
    executor.forget("penalised")
    expected = reference_sample(reference, prompt, _reference_params(fields), len(prompt), 12)
    assert outputs["penalised"] == expected
    assert first not in expected[:4], "min_tokens masks its stop_token_ids"


def test_penalties_count_the_history_before_a_cached_prefix(
    executor: Executor, reference: Reference
) -> None:
    # A penalised request starts past a prefix another request computed (its first block),
    # sending that prefix as history_token_ids: it decodes as the reference does from the
    # whole prompt, where the repetition penalty counts the prefix's tokens too.
    require_model_logits(executor)
    size = executor.info.block_size
    prompt = _prompts(executor.info.vocab_size, [size + 5], seed=12)[0]
    executor.execute(executor.work("prefix-owner", prompt, sample=False))
    own = executor.blocks.take(1)
    fields = {**PENALISED, "num_prompt_tokens": len(prompt)}
    work = pb.SequenceWork(
        request_id="prefixed", sampling=pb.SamplingParams(**fields), token_ids=prompt[size:],
        start_position=size, sample=True, history_token_ids=prompt[:size],
        delta=pb.BlockTableDelta(block_ids=[executor.tables["prefix-owner"][0], *own]),
    )
    outputs = {"prefixed": [executor.execute(work).tokens[0].token_id]}
    shared = executor.tables["prefix-owner"][0]
    executor.tables["prefixed"], executor.held["prefixed"] = [shared, *own], len(prompt)
    _decode(executor, outputs, 7)
    executor.tables["prefixed"].remove(shared)  # it goes back once, with its owner
    executor.forget("prefixed", "prefix-owner")
    expected = reference_sample(reference, prompt, _reference_params(fields), len(prompt), 8)
    assert outputs["prefixed"] == expected


def _assert_top(top: list[tuple[int, float]], raw: torch.Tensor, k: int) -> None:
    """`top` is the raw distribution's k most likely (ties and float noise allowed)."""
    assert len(top) == k
    for token_id, logprob in top:
        assert logprob == pytest.approx(raw[token_id].item(), abs=1e-3)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top[-1][1] >= torch.topk(raw, k + 1).values[-1].item() - 1e-3


def test_top_logprobs_are_the_raw_distributions(
    executor: Executor, reference: Reference
) -> None:
    # top_logprobs 5 (with a penalty and a temperature that do not touch them): SampledToken
    # carries the raw log-softmax's 5 most likely, a plain request none; in the compact
    # columns decode_num_top_logprobs says 5 and 0 and the entries follow row by row.
    a, b = _prompts(executor.info.vocab_size, [9, 6], seed=13)
    reply = executor.execute(
        executor.work("top", a, top_logprobs=5, repetition_penalty=2.0, temperature=0.5,
                      seed=3),
        executor.work("no-top", b),
    )
    top, plain = reply.tokens
    raw = reference_logprobs(reference, a)[-1]
    assert top.logprob == pytest.approx(raw[top.token_id].item(), abs=1e-3)
    _assert_top([(t.token_id, t.logprob) for t in top.top_logprobs], raw, 5)
    assert list(plain.top_logprobs) == []
    reply = executor.stub.Execute(pb.ExecuteRequest(
        decode_request_ids=["top", "no-top"], decode_token_ids=[top.token_id, plain.token_id],
        decode_positions=[len(a), len(b)]))
    executor.held["top"] += 1
    executor.held["no-top"] += 1
    executor.forget("top", "no-top")
    assert list(reply.decode_num_top_logprobs) == [5, 0]
    entries = list(zip(reply.decode_top_token_ids, reply.decode_top_logprobs, strict=True))
    _assert_top(entries, reference_logprobs(reference, [*a, top.token_id])[-1], 5)


def _prompt_entries(replies: list[pb.ExecuteResponse], rid: str
                    ) -> list[tuple[int, float, int, list[tuple[int, float]]]]:
    """(position, logprob, rank, top) for every prompt token `rid`'s replies carried."""
    out = []
    for reply in replies:
        for run in (r for r in reply.prompt_logprobs if r.request_id == rid):
            k = run.num_top_logprobs
            assert len(run.logprobs) == len(run.ranks)
            assert len(run.top_token_ids) == len(run.top_logprobs) == k * len(run.logprobs)
            for i, (logprob, rank) in enumerate(zip(run.logprobs, run.ranks, strict=True)):
                top = list(zip(run.top_token_ids[i * k:(i + 1) * k],
                               run.top_logprobs[i * k:(i + 1) * k], strict=True))
                out.append((run.first_position + i, logprob, rank, top))
    return out


def test_prompt_logprobs_are_each_prompt_tokens_under_the_raw_distribution(
    executor: Executor, reference: Reference
) -> None:
    # A prompt in two chunks asking for its logprobs and 2 top ones: one entry per prompt
    # token after the first, in order, whichever chunk computed the row before it (the
    # first chunk's last row gives the second chunk's first token); a request starting past
    # a cached prefix gets entries only for the rows it computes; a plain request none.
    size = executor.info.block_size
    a, b, c = _prompts(executor.info.vocab_size, [11, 7, size + 5], seed=17)
    asking = {"prompt_logprobs": 2, "num_prompt_tokens": len(a)}
    first = executor.work("prompt-lp", a[:6], sample=False, **asking)
    first.prompt_token_ids.extend(a)
    replies = [executor.execute(first, executor.work("plain", b))]
    replies.append(executor.execute(executor.work("prompt-lp", a[6:])))
    entries = _prompt_entries(replies, "prompt-lp")
    assert [e[0] for e in entries] == list(range(1, len(a)))
    raw = reference_logprobs(reference, a)
    for position, logprob, rank, top in entries:
        row = raw[position - 1]
        assert logprob == pytest.approx(row[a[position]].item(), abs=1e-3)
        value = row[a[position]]  # its rank, float noise allowed
        assert int((row > value + 1e-3).sum()) + 1 <= rank <= int((row > value - 1e-3).sum()) + 1
        _assert_top(top, row, 2)
    assert _prompt_entries(replies, "plain") == []
    # Past a one-block prefix that another request computed (its own block after it).
    executor.execute(executor.work("lp-owner", c[:size], sample=False))
    own = executor.blocks.take(1)
    work = pb.SequenceWork(
        request_id="lp-prefixed", token_ids=c[size:], start_position=size, sample=True,
        sampling=pb.SamplingParams(prompt_logprobs=0, num_prompt_tokens=len(c)),
        prompt_token_ids=c,
        delta=pb.BlockTableDelta(block_ids=[executor.tables["lp-owner"][0], *own]))
    prefixed = _prompt_entries([executor.execute(work)], "lp-prefixed")
    executor.blocks.free.extend(own)
    executor.stub.Release(pb.ReleaseRequest(request_ids=["lp-prefixed"]))
    executor.forget("prompt-lp", "plain", "lp-owner")
    assert [e[0] for e in prefixed] == list(range(size + 1, len(c)))
    assert all(top == [] for *_, top in prefixed)
    raw = reference_logprobs(reference, c)  # read through the shared block, as computed
    for position, logprob, _, _ in prefixed:
        assert logprob == pytest.approx(raw[position - 1][c[position]].item(), abs=1e-3)
