"""The runner against transformers itself: logits and greedy continuations, per family."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_svc.runner import ModelRunner
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

from .oracle import (
    FAMILIES,
    Driver,
    random_prompts,
    reference_generate,
    reference_logits,
    reference_model,
)

LENGTHS = [3, 17, 30, 50]  # mixed: under, at, and over block boundaries
NUM_NEW = 32


@pytest.mark.parametrize("preset", FAMILIES)
def test_runner_prefill_logits_match_dense_forward(
    make_runner: Callable[..., ModelRunner], preset: str
) -> None:
    # Three prompts in one packed step; each prompt's last logits equal transformers' forward.
    runner = make_runner(preset)
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, [5, 33, 20])
    driver = Driver.scattered(runner)
    seqs = tuple(driver.work(f"r{i}", p, sample=True) for i, p in enumerate(prompts))
    logits = runner.run_forward(StepRequest(seqs=seqs)).logits  # [3, V]
    for row, prompt in enumerate(prompts):
        expected = reference_logits(reference, prompt)[-1]  # [V]
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_runner_greedy_matches_generate(
    make_runner: Callable[..., ModelRunner], preset: str, backend: str
) -> None:
    # A batch of mixed-length prompts decodes 32 tokens token-identical to model.generate,
    # with the C++ decode kernel and with the torch reference.
    runner = make_runner(preset, backend=backend)
    assert runner.info.backend == backend
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, LENGTHS, seed=1)
    got = Driver.scattered(runner).generate({f"r{i}": p for i, p in enumerate(prompts)}, NUM_NEW)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_generate(reference, prompt, NUM_NEW), f"prompt {i}"


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_runner_greedy_matches_generate_for_block_size(
    make_runner: Callable[..., ModelRunner], block_size: int
) -> None:
    # Block sizes 1, 16 and 32 give the same continuations as transformers.
    runner = make_runner("tiny-llama", block_size=block_size, num_blocks=4096 // block_size)
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, LENGTHS, seed=2)
    got = Driver.scattered(runner).generate({f"r{i}": p for i, p in enumerate(prompts)}, 16)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_generate(reference, prompt, 16), f"prompt {i}"


@pytest.mark.parametrize("preset", FAMILIES)
def test_runner_chunked_prefill_matches_generate(
    make_runner: Callable[..., ModelRunner], preset: str
) -> None:
    # Prompts prefilled in 7-token chunks (crossing block boundaries) continue like generate.
    runner = make_runner(preset)
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, LENGTHS, seed=3)
    got = Driver.scattered(runner).generate({f"r{i}": p for i, p in enumerate(prompts)}, 8, chunk=7)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_generate(reference, prompt, 8), f"prompt {i}"


def test_runner_chunked_prefill_logits_match_dense_forward(tiny_runner: ModelRunner) -> None:
    # Every chunk's last-position logits equal the dense forward at that position.
    reference = reference_model(tiny_runner)
    prompt = random_prompts(tiny_runner.info.vocab_size, [45], seed=4)[0]
    expected = reference_logits(reference, prompt)  # [45, V]
    driver = Driver.scattered(tiny_runner)
    for start in range(0, 45, 10):
        chunk = prompt[start : start + 10]
        seqs = (driver.work("r", chunk, sample=True),)
        logits = tiny_runner.run_forward(StepRequest(seqs=seqs)).logits  # [1, V]
        position = start + len(chunk) - 1
        torch.testing.assert_close(logits[0], expected[position], atol=1e-4, rtol=0)


def test_runner_scattered_blocks_match_contiguous_blocks(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # The same prompts through blocks 0, 1, 2... and through shuffled high/low ids agree exactly.
    prompts = random_prompts(512, LENGTHS, seed=5)
    named = {f"r{i}": p for i, p in enumerate(prompts)}
    contiguous_runner = make_runner("tiny-llama")
    contiguous = Driver(contiguous_runner, free_blocks=list(range(255, -1, -1)))
    scattered = Driver.scattered(make_runner("tiny-llama"), seed=99)
    assert contiguous.generate(named, 12) == scattered.generate(named, 12)
    assert scattered.tables["r3"] != sorted(scattered.tables["r3"])


def test_runner_copy_on_write_fork_continues_like_generate(tiny_runner: ModelRunner) -> None:
    # The parent prefills 20 tokens into [shared, partial]; a child forks with table
    # [shared, copy of partial] (one copy op in the same step); both decode greedily and each
    # matches generate, so neither wrote into the other's partial block.
    reference = reference_model(tiny_runner)
    prompt = random_prompts(tiny_runner.info.vocab_size, [20], seed=6)[0]
    driver = Driver.scattered(tiny_runner)
    first = tiny_runner.execute(StepRequest(seqs=(driver.work("parent", prompt, sample=True),)))
    token = first.tokens[0].token_id
    shared, partial = driver.tables["parent"]
    copy_dst = driver.free_blocks.pop()
    child = SequenceWork(
        request_id="child",
        token_ids=(token,),
        start_position=20,  # a cached prefix: the first step of a new request may start late
        delta=BlockTableDelta(0, (shared, copy_dst)),
        sampling=SamplingParams(),
        sample=True,
    )
    driver.tables["child"], driver.num_tokens["child"] = [shared, copy_dst], 21
    step = StepRequest(
        seqs=(driver.work("parent", [token], sample=True), child),
        copies=(BlockCopy(partial, copy_dst),),
    )
    outputs = {"parent": [token], "child": [token]}
    for sampled in tiny_runner.execute(step).tokens:
        outputs[sampled.request_id].append(sampled.token_id)
    for _ in range(10):
        seqs = tuple(driver.work(rid, [out[-1]], sample=True) for rid, out in outputs.items())
        for sampled in tiny_runner.execute(StepRequest(seqs=seqs)).tokens:
            outputs[sampled.request_id].append(sampled.token_id)
    expected = reference_generate(reference, prompt, 12)
    assert outputs == {"parent": expected, "child": expected}


def test_runner_swap_out_and_in_continues_like_generate(tiny_runner: ModelRunner) -> None:
    # Decode 4 tokens, swap the blocks out, let another request overwrite them, swap back into
    # different device blocks, and continue: the continuation still equals generate.
    reference = reference_model(tiny_runner)
    prompt, intruder = random_prompts(tiny_runner.info.vocab_size, [40, 60], seed=8)
    driver = Driver.scattered(tiny_runner)
    out = driver.generate({"r": prompt}, 4)["r"]
    device_blocks = driver.tables["r"]
    cpu_blocks = list(range(len(device_blocks)))
    tiny_runner.execute(StepRequest(swap_out=tuple(map(BlockCopy, device_blocks, cpu_blocks))))
    # The freed device blocks go to an intruder that fills them with other K/V.
    driver.free_blocks.extend(device_blocks)
    driver.generate({"intruder": intruder}, 1)
    assert set(device_blocks) & set(driver.tables["intruder"])
    new_blocks = [driver.free_blocks.pop(0) for _ in device_blocks]
    driver.tables["r"] = new_blocks
    resume = SequenceWork(
        request_id="r",
        token_ids=(out[-1],),
        start_position=len(prompt) + 3,
        delta=BlockTableDelta(0, tuple(new_blocks)),
        sample=True,
    )
    step = StepRequest(
        release_request_ids=("intruder",),
        swap_in=tuple(map(BlockCopy, cpu_blocks, new_blocks)),
        seqs=(resume,),
    )
    out.append(tiny_runner.execute(step).tokens[0].token_id)
    driver.num_tokens["r"] = len(prompt) + 4
    for _ in range(6):
        step = StepRequest(seqs=(driver.work("r", [out[-1]], sample=True),))
        out.append(tiny_runner.execute(step).tokens[0].token_id)
    assert out == reference_generate(reference, prompt, 11)


def test_runner_drops_requests_no_step_has_used_for_idle_release_s(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # A caller that died never releases its requests: past idle_release_s without a step
    # they are dropped (a later step of theirs is NOT_FOUND-level unknown); a request still
    # stepping is kept. The clock is the runner's own, injected.
    runner = make_runner("tiny-llama")
    now = [0.0]
    runner.clock = lambda: now[0]
    runner.idle_release_s = 60.0
    runner.next_idle_check = 6.0
    driver = Driver.scattered(runner)
    driver.generate({"dead": [5, 6, 7], "alive": [8, 9, 10]}, num_new=2)
    assert set(runner.requests) == {"dead", "alive"}
    for t in (30.0, 59.0, 70.0):
        now[0] = t
        out: dict[str, list[int]] = {"alive": []}
        driver._collect(StepRequest(seqs=(driver.work("alive", [11], sample=True),)), out)
    assert set(runner.requests) == {"alive"}
    # A request idle past the limit that a step names again is kept (and served).
    now[0] = 200.0
    runner.next_idle_check = 0.0
    driver._collect(StepRequest(seqs=(driver.work("alive", [12], sample=True),)), {"alive": []})
    assert set(runner.requests) == {"alive"}
    runner.idle_release_s = 0.0  # never
    now[0] = 1e6
    driver._collect(StepRequest(seqs=(driver.work("alive", [13], sample=True),)), {"alive": []})
    assert set(runner.requests) == {"alive"}
