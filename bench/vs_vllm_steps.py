"""The executor's steps in process against vLLM CPU's offline engine on the same shapes.

    .venv/bin/python -m bench.vs_vllm_steps [--repeats 3] [--dtype bfloat16]

Where `bench.vs_vllm` compares whole systems, this asks whether the gap is in the model's
steps or around them. Same model (the embedded SmolLM2-135M, fp32 or `--dtype bfloat16`),
same prompts, greedy:
  prefill   16 prompts x 128 tokens, one output token: one step of 2,048 tokens in both
  decode N  N prompts of 160 tokens (N = 1, 16, 64): the time of one decode step of N
            sequences
  mixed, equal  bench.vs_vllm's two throughput workloads, 64 requests with fresh prompts
            each repeat, output tok/s; the ratio is the median of the repeats' own ratios.
            pagedkv's steps are driven by a plain loop in this process (each step: every
            running sequence's next token, then whole waiting prompts within 2,048 tokens, as
            the gateway's defaults schedule them), with no services and no RPC: what the
            three-service stack could reach at most with today's steps
pagedkv: the executor's ModelRunner in this process (two threads, malloc tuned as the executor
tunes it), timed around its steps (bench.fused_layers' helpers). vLLM: `LLM.generate` in its
own virtualenv, in its best configuration (bench.vs_vllm's), timed around the call; a decode
step is (generate with 1 + D tokens - generate with 1 token) / D, D = 16, so it includes
vLLM's own per-step work (scheduling, its engine process hand-over, detokenizing), its
contexts average 8 tokens longer than pagedkv's four timed steps (attention over ~5% more
keys), and the prefill row is the whole call (the median of three calls each repeat, fresh
prompts each). Interleaved, medians. Writes
bench/results/vs_vllm_steps.json.
"""

from __future__ import annotations

from executor_svc.malloc_tuning import tune_malloc

tune_malloc()  # before torch allocates, as executor_svc/__main__.py does

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench import fused_layers  # noqa: E402
from bench.baselines import BenchRequest  # noqa: E402
from bench.common import markdown_table, write_results  # noqa: E402
from bench.vs_vllm import (  # noqa: E402
    FIRST_ID,
    REQUESTS_PER_RUN,
    VLLM_PYTHON,
    VOCAB,
    VllmOffline,
    agreement,
    equal_requests,
    mixed_requests,
)
from common.model_dirs import DEFAULT_MODEL  # noqa: E402
from executor_svc.runner import ModelRunner  # noqa: E402
from executor_svc.step import (  # noqa: E402
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

DECODE_BATCHES = (1, 16, 64)
DECODE_TOKENS = 16
PREFILL_CALLS = 3  # one 1.5 s step varies by 10-20% between calls: each repeat takes a median
WORKLOADS = {"mixed": mixed_requests, "equal": equal_requests}
STEP_TOKENS = 2048  # the gateway's --max-num-batched-tokens default


def _requests(seed: int, count: int, length: int, output_len: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(FIRST_ID, VOCAB) for _ in range(length)], output_len)
            for _ in range(count)]


def vllm_steps(vllm: VllmOffline, seed: int) -> dict[str, float]:
    prompts, length = fused_layers.PREFILL_PROMPTS, fused_layers.PREFILL_LEN
    out = {"prefill": statistics.median(
        vllm.generate(_requests(1000 + seed * 10 + i, prompts, length, 1))[1]
        for i in range(PREFILL_CALLS))}
    for batch in DECODE_BATCHES:
        base = _requests(seed * 10 + batch, batch, fused_layers.CONTEXT, 1)
        longer = _requests(seed * 10 + batch + 5, batch, fused_layers.CONTEXT, 1 + DECODE_TOKENS)
        one, many = vllm.generate(base)[1], vllm.generate(longer)[1]
        out[f"decode {batch}"] = (many - one) / DECODE_TOKENS
    return out


def pagedkv_steps(runner: ModelRunner, seed: int) -> dict[str, float]:
    out = {"prefill": statistics.median(
        fused_layers.prefill_seconds(runner, 1000 + seed * 10 + i) for i in range(PREFILL_CALLS))}
    for batch in DECODE_BATCHES:
        out[f"decode {batch}"] = fused_layers.decode_seconds(runner, seed * 10 + batch, batch)[0]
    return out


def run_workload(runner: ModelRunner, requests: list[BenchRequest]
                 ) -> tuple[list[list[int]], float]:
    """Every request to its output length, greedy; (outputs, wall seconds).

    Each step: one token for every running sequence, then whole waiting prompts in order
    while the step stays within STEP_TOKENS (these workloads' prompts are at most 512);
    finished sequences are released by the next step, as the gateway does.
    """
    size = runner.info.block_size
    outputs: list[list[int]] = [[] for _ in requests]
    waiting = list(range(len(requests)))[::-1]  # popped from the end: first come first
    running: list[int] = []
    finished: tuple[str, ...] = ()
    next_block = 0
    start = time.perf_counter()
    while waiting or running:
        seqs = [SequenceWork(str(i), (outputs[i][-1],),
                             len(requests[i].prompt) + len(outputs[i]) - 1, None, None, True)
                for i in running]
        budget = STEP_TOKENS - len(seqs)
        while waiting and len(requests[waiting[-1]].prompt) <= budget:
            i = waiting.pop()
            prompt = requests[i].prompt
            count = -(-(len(prompt) + requests[i].output_len) // size)
            delta = BlockTableDelta(0, tuple(range(next_block, next_block + count)))
            next_block += count
            seqs.append(SequenceWork(str(i), tuple(prompt), 0, delta, SamplingParams(), True))
            budget -= len(prompt)
            running.append(i)
        step = StepRequest(seqs=tuple(seqs), release_request_ids=finished)
        for token in runner.execute(step).tokens:
            outputs[int(token.request_id)].append(token.token_id)
        finished = tuple(str(i) for i in running if len(outputs[i]) == requests[i].output_len)
        running = [i for i in running if len(outputs[i]) < requests[i].output_len]
    elapsed = time.perf_counter() - start
    runner.execute(StepRequest(release_request_ids=finished))
    return outputs, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_vllm_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="both engines' dtype (bfloat16: results/vs_vllm_steps_bf16.json)")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print("vLLM CPU's virtualenv is missing: run `make bench-vllm` (it creates "
              ".venv-vllm)", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    runner = fused_layers.build(str(DEFAULT_MODEL), dtype=args.dtype)
    log = Path(tempfile.mkdtemp(prefix="pagedkv-vs-vllm-steps-")) / "vllm.log"
    vllm = VllmOffline(str(DEFAULT_MODEL), args.dtype, log)
    times: dict[str, dict[str, list[float]]] = {"vllm": {}, "pagedkv": {}}
    rates: dict[str, dict[str, list[float]]] = {"vllm": {}, "pagedkv": {}}
    outputs: dict[str, dict[str, list[list[int]]]] = {"vllm": {}, "pagedkv": {}}
    try:
        vllm.generate(mixed_requests(16, seed=99))  # warm-up, both
        pagedkv_steps(runner, 99)
        for rep in range(args.repeats):
            order = ("vllm", "pagedkv") if rep % 2 == 0 else ("pagedkv", "vllm")
            for system in order:
                print(f"[vs_vllm_steps] rep {rep + 1}/{args.repeats}: {system}",
                      file=sys.stderr, flush=True)
                got = vllm_steps(vllm, rep) if system == "vllm" else pagedkv_steps(runner, rep)
                for step, seconds in got.items():
                    times[system].setdefault(step, []).append(seconds)
                for name, make_requests in WORKLOADS.items():
                    requests = make_requests(REQUESTS_PER_RUN, 100 + rep)  # fresh each repeat
                    outs, wall = (vllm.generate(requests) if system == "vllm"
                                  else run_workload(runner, requests))
                    assert [len(o) for o in outs] == [r.output_len for r in requests], system
                    rates[system].setdefault(name, []).append(
                        sum(r.output_len for r in requests) / wall)
                    outputs[system].setdefault(name, []).extend(outs)
    finally:
        vllm.close()
    rows = []
    for step in times["pagedkv"]:
        ours = statistics.median(times["pagedkv"][step]) * 1e3
        theirs = statistics.median(times["vllm"][step]) * 1e3
        rows.append({"step": step, "pagedkv_ms": round(ours, 1), "vllm_ms": round(theirs, 1),
                     "pagedkv/vllm": round(ours / theirs, 3)})
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    workload_rows: list[dict[str, Any]] = []
    for name in WORKLOADS:
        ours, theirs = (statistics.median(rates[s][name]) for s in ("pagedkv", "vllm"))
        # Each repeat has its own prompts and output lengths: compare within a repeat.
        paired = statistics.median(a / b for a, b in zip(rates["pagedkv"][name],
                                                         rates["vllm"][name], strict=True))
        workload_rows.append({
            "workload": name, "pagedkv_tok_per_s": round(ours, 1),
            "vllm_tok_per_s": round(theirs, 1), "pagedkv/vllm": round(paired, 3),
            "agreement": agreement(outputs["vllm"][name], outputs["pagedkv"][name]),
        })
    print()
    print(markdown_table(["workload (executor alone)", "pagedkv tok/s", "vLLM tok/s",
                          "pagedkv / vLLM", "outputs identical"],
                         [[r["workload"], r["pagedkv_tok_per_s"], r["vllm_tok_per_s"],
                           f"{r['pagedkv/vllm']:.2f}x",
                           f"{r['agreement']['full']}/{r['agreement']['requests']}"]
                          for r in workload_rows]))
    name = "vs_vllm_steps" if args.dtype == "float32" else "vs_vllm_steps_bf16"
    write_results(name, {
        "model": str(DEFAULT_MODEL), "dtype": args.dtype, "threads": 2, "repeats": args.repeats,
        "decode_tokens": DECODE_TOKENS, "context": fused_layers.CONTEXT, "rows": rows,
        "samples_ms": {system: {step: [round(v * 1e3, 2) for v in values]
                                for step, values in steps.items()}
                       for system, steps in times.items()},
        "workloads": workload_rows,
        "workload_samples_tok_per_s": rates,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
