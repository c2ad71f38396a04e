"""The executor's step against the same runner without its CPU speed-ups, in one process,
interleaved.

    .venv/bin/python -m bench.fused_layers [--repeats 3] [--model DIR] [--baseline plain]
    .venv/bin/python -m bench.fused_layers --baseline unpacked

Two runners on the same model (default: the embedded SmolLM2-135M, fp32, two threads, glibc
malloc tuned as the executor tunes it): one as the executor builds it, and a baseline:
  plain     transformers' modules (`fused_layers.fuse_layers` off), float32 linear layers on
            F.linear (`packed_linear.pack_linears` off) and every prompt attended in its own
            SDPA call (the backend's grouping of fresh prompts switched off);
  unpacked  the executor's runner with float32 linear layers on F.linear (no MKL packing).
Per repeat, in alternating order: one prefill step of 16 prompts x 128 tokens, and decode
steps of 1, 4, 16 and 64 sequences at 160 tokens of context (four steps each, after their
prefill). Medians and the executor/baseline ratio; the tokens sampled by both runners are
compared. Writes bench/results/fused_layers.json (plain) or packed_linears.json (unpacked).
"""

from __future__ import annotations

from executor_svc.malloc_tuning import tune_malloc

tune_malloc()  # before torch allocates, as executor_svc/__main__.py does

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402

import executor_svc.attention.torch_backend as torch_backend  # noqa: E402
import executor_svc.model_loader as model_loader  # noqa: E402
from bench.common import markdown_table, write_results  # noqa: E402
from common.model_dirs import REPO_ROOT  # noqa: E402
from executor_svc.runner import ModelRunner, build_runner  # noqa: E402
from executor_svc.settings import ExecutorSettings  # noqa: E402
from executor_svc.step import (  # noqa: E402
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

DEFAULT_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
DECODE_BATCHES = (1, 4, 16, 64)
CONTEXT, DECODE_STEPS = 160, 4
PREFILL_PROMPTS, PREFILL_LEN = 16, 128


@contextmanager
def plain_prompts(plain: bool) -> Iterator[None]:
    """Every fresh prompt in its own SDPA call (no grouping) while `plain`."""
    saved = torch_backend.FRESH_PADDING["cpu"]
    if plain:
        torch_backend.FRESH_PADDING["cpu"] = (0.0, -1)
    try:
        yield
    finally:
        torch_backend.FRESH_PADDING["cpu"] = saved


def build(model: str, fused: bool = True, packed: bool = True,
          dtype: str = "float32") -> ModelRunner:
    """The executor's runner; without `fused`, transformers' modules; without `packed`, float32
    linear layers on F.linear."""
    settings = ExecutorSettings(
        model=model, seed=0, dtype=dtype, kv_cache_memory=2**30, swap_space=0.0,
        max_num_batched_tokens=2048,
    )
    real_fuse, real_pack = model_loader.fuse_layers, model_loader.pack_linears
    if not fused:
        model_loader.fuse_layers = lambda model, kernel: 0  # type: ignore[assignment]
    if not packed:  # bfloat16 keeps its oneDNN packing: only float32 layers are compared
        model_loader.pack_linears = lambda model, kernels: real_pack(model, None)  # type: ignore[assignment]
    try:
        return build_runner(settings)
    finally:
        model_loader.fuse_layers, model_loader.pack_linears = real_fuse, real_pack


def _prompts(seed: int, count: int, length: int, vocab: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(17, vocab) for _ in range(length)) for _ in range(count)]


def _admit(runner: ModelRunner, tag: str, prompts: list[tuple[int, ...]], room: int) -> list[str]:
    size, next_block, ids = runner.info.block_size, 0, []
    seqs = []
    for i, prompt in enumerate(prompts):
        count = -(-(len(prompt) + room) // size)
        blocks = tuple(range(next_block, next_block + count))
        next_block += count
        ids.append(f"{tag}-{i}")
        delta = BlockTableDelta(0, blocks)
        seqs.append(SequenceWork(ids[-1], prompt, 0, delta, SamplingParams(), True))
    for start in range(0, len(seqs), 12):  # within max_num_batched_tokens
        runner.execute(StepRequest(seqs=tuple(seqs[start : start + 12])))
    return ids


def prefill_seconds(runner: ModelRunner, seed: int) -> float:
    prompts = _prompts(seed, PREFILL_PROMPTS, PREFILL_LEN, runner.info.vocab_size)
    seqs, size = [], runner.info.block_size
    for i, prompt in enumerate(prompts):
        count = -(-len(prompt) // size)
        blocks = tuple(range(i * count, (i + 1) * count))
        delta = BlockTableDelta(0, blocks)
        seqs.append(SequenceWork(f"p{i}", prompt, 0, delta, SamplingParams(), True))
    start = time.perf_counter()
    runner.execute(StepRequest(seqs=tuple(seqs)))
    elapsed = time.perf_counter() - start
    runner.release(tuple(s.request_id for s in seqs))
    return elapsed


def decode_seconds(runner: ModelRunner, seed: int, batch: int) -> tuple[float, list[int]]:
    prompts = _prompts(seed, batch, CONTEXT, runner.info.vocab_size)
    ids = _admit(runner, f"d{batch}", prompts, DECODE_STEPS)
    tokens: list[int] = []
    start = time.perf_counter()
    for step in range(DECODE_STEPS):
        seqs = tuple(SequenceWork(i, (5,), CONTEXT + step, None, None, True) for i in ids)
        tokens += [t.token_id for t in runner.execute(StepRequest(seqs=seqs)).tokens]
    elapsed = (time.perf_counter() - start) / DECODE_STEPS
    runner.release(tuple(ids))
    return elapsed, tokens


BASELINES = {"plain": dict(fused=False, packed=False), "unpacked": dict(fused=True, packed=False)}
RESULTS = {"plain": "fused_layers", "unpacked": "packed_linears"}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fused_layers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", choices=sorted(BASELINES), default="plain")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = args.baseline
    runners = {"executor": build(args.model), base: build(args.model, **BASELINES[base])}
    times: dict[tuple[str, str], list[float]] = {}
    agree = total = 0
    for rep in range(args.repeats):
        order = ("executor", base) if rep % 2 == 0 else (base, "executor")
        sampled: dict[str, list[int]] = {}
        for name in order:
            with plain_prompts(name == "plain"):
                times.setdefault(("prefill 16x128", name), []).append(
                    prefill_seconds(runners[name], rep)
                )
                sampled[name] = []
                for batch in DECODE_BATCHES:
                    seconds, tokens = decode_seconds(runners[name], rep * 10 + batch, batch)
                    times.setdefault((f"decode {batch}", name), []).append(seconds)
                    sampled[name] += tokens
        pairs = list(zip(sampled["executor"], sampled[base], strict=True))
        agree += sum(a == b for a, b in pairs)
        total += len(pairs)
    rows = []
    for step in ["prefill 16x128", *(f"decode {b}" for b in DECODE_BATCHES)]:
        ours = statistics.median(times[(step, "executor")]) * 1e3
        theirs = statistics.median(times[(step, base)]) * 1e3
        rows.append({"step": step, "executor_ms": round(ours, 1), f"{base}_ms": round(theirs, 1),
                     f"executor/{base}": round(ours / theirs, 3)})
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    print(f"sampled tokens equal: {agree}/{total}")
    path = write_results(RESULTS[base], {
        "model": args.model, "threads": args.threads, "repeats": args.repeats,
        "baseline": base, "rows": rows, "tokens_equal": agree, "tokens_compared": total,
        "samples_ms": {f"{k[0]} / {k[1]}": [round(v * 1e3, 2) for v in vs]
                       for k, vs in times.items()},
    })
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
