"""Executor throughput against transformers' own generate, in one run, on the same weights.

    .venv/bin/python -m bench.executor_bench            # full (several minutes on 2 cores)
    .venv/bin/python -m bench.executor_bench --quick    # under 3 minutes
    .venv/bin/python -m bench.executor_bench --gpu      # FlashInfer decode bandwidth (CUDA)

CPU: the small preset (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 32,000, fp32, seeded
dummy weights). For batches of 1, 16 and 64 prompts, either all 512 tokens long ("equal") or
spread evenly over 32..1,024 ("spread"):
- paged: the executor's runner in process (no gRPC), prompts prefilled in packed steps under
  max_num_batched_tokens, then one decode step per new token for the whole batch;
- transformers: `model.generate` greedy on a left-padded batch (dense cache, sdpa).
Tokens/s count real tokens only (padding is not work). Prefill time runs to the first sampled
token (generate: its first logits, seen by a logits processor that only records the time);
decode time covers the remaining N - 1 tokens. Systems are interleaved within each repetition
(alternating which goes first) and medians are reported with the paged/transformers ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
)

from bench.common import markdown_table, write_results
from common.logging import configure_logging
from executor_svc.runner import ModelRunner, build_runner
from executor_svc.settings import ExecutorSettings
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "models" / "small-llama"


@dataclass(frozen=True, slots=True)
class Measurement:
    workload: str
    batch: int
    system: str
    prefill_tok_s: float
    decode_tok_s: float


def prompt_lengths(workload: str, batch: int, scale: float = 1.0) -> list[int]:
    """equal: 512 each; spread: evenly over 32..1,024 (batch 1: the middle). Scaled in --quick."""
    if workload == "equal":
        lengths = [512] * batch
    elif batch == 1:
        lengths = [528]
    else:
        lengths = [round(32 + i * (1024 - 32) / (batch - 1)) for i in range(batch)]
    return [max(1, round(n * scale)) for n in lengths]


def prompts_for(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def run_paged(
    runner: ModelRunner, prompts: list[list[int]], num_new: int
) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds, decode seconds, tokens) for one batch; blocks handed out in order."""
    size, budget = runner.info.block_size, runner.info.max_num_batched_tokens
    next_block = 0
    tables: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}

    def work(rid: str, tokens: list[int], start: int, sample: bool, first: bool) -> SequenceWork:
        nonlocal next_block
        table = tables.setdefault(rid, [])
        needed = -(-(start + len(tokens)) // size) - len(table)
        new = tuple(range(next_block, next_block + needed))
        next_block += needed
        delta = BlockTableDelta(len(table), new) if new else None
        table.extend(new)
        sampling = SamplingParams() if first else None
        return SequenceWork(rid, tuple(tokens), start, delta, sampling, sample)

    start_time = time.perf_counter()
    offsets = [0] * len(prompts)
    while any(o < len(p) for o, p in zip(offsets, prompts, strict=True)):
        seqs, room = [], budget
        for i, prompt in enumerate(prompts):
            if offsets[i] == len(prompt) or room == 0:
                continue
            end = min(len(prompt), offsets[i] + room)
            seqs.append(
                work(
                    f"r{i}",
                    prompt[offsets[i] : end],
                    offsets[i],
                    end == len(prompt),
                    offsets[i] == 0,
                )
            )
            room -= end - offsets[i]
            offsets[i] = end
        for token in runner.execute(StepRequest(seqs=tuple(seqs))).tokens:
            outputs[token.request_id] = [token.token_id]
    prefill_s = time.perf_counter() - start_time
    start_time = time.perf_counter()
    for step in range(num_new - 1):
        seqs = [
            work(f"r{i}", [outputs[f"r{i}"][-1]], len(p) + step, True, False)
            for i, p in enumerate(prompts)
        ]
        for token in runner.execute(StepRequest(seqs=tuple(seqs))).tokens:
            outputs[token.request_id].append(token.token_id)
    decode_s = time.perf_counter() - start_time
    runner.release(tuple(tables))
    return prefill_s, decode_s, [outputs[f"r{i}"] for i in range(len(prompts))]


class StepClock(LogitsProcessor):
    """Records when generate hands each step's logits over: after prefill, after each decode."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


def run_generate(
    model: PreTrainedModel, prompts: list[list[int]], num_new: int
) -> tuple[float, float, list[list[int]]]:
    """One generate call; prefill ends at the first logits, decode spans the rest."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)  # [B, L] left-padded with 0
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)  # [B, L]
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    clock = StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
    end = time.perf_counter()
    assert len(clock.stamps) == num_new
    prefill_s = clock.stamps[0] - start
    return prefill_s, end - clock.stamps[0], output[:, longest:].tolist()


def measure(
    runner: ModelRunner,
    model: PreTrainedModel,
    batches: list[int],
    num_new: int,
    repeat: int,
    scale: float,
) -> tuple[list[Measurement], dict[str, float]]:
    samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    agreement: dict[str, float] = {}
    for rep in range(repeat):
        for workload in ("equal", "spread"):
            for batch in batches:
                lengths = prompt_lengths(workload, batch, scale)
                prompts = prompts_for(lengths, runner.info.vocab_size, seed=rep)
                real = sum(lengths)
                order = ("paged", "transformers") if rep % 2 == 0 else ("transformers", "paged")
                outs: dict[str, list[list[int]]] = {}
                for system in order:
                    run = run_paged if system == "paged" else run_generate
                    target = runner if system == "paged" else model
                    prefill_s, decode_s, outs[system] = run(target, prompts, num_new)  # type: ignore[operator]
                    rates = (real / prefill_s, batch * (num_new - 1) / decode_s)
                    samples.setdefault((workload, batch, system), []).append(rates)
                same = sum(a == b for a, b in zip(outs["paged"], outs["transformers"], strict=True))
                agreement[f"{workload}/{batch}"] = same / batch
                print(f"# rep {rep} {workload} batch {batch}: done", flush=True)
    results = [
        Measurement(
            workload=w,
            batch=b,
            system=s,
            prefill_tok_s=statistics.median(r[0] for r in rates),
            decode_tok_s=statistics.median(r[1] for r in rates),
        )
        for (w, b, s), rates in samples.items()
    ]
    return results, agreement


def report(results: list[Measurement], agreement: dict[str, float]) -> list[dict[str, Any]]:
    by_key = {(m.workload, m.batch, m.system): m for m in results}
    rows, table = [], []
    for workload, batch in sorted({(m.workload, m.batch) for m in results}):
        paged, dense = by_key[(workload, batch, "paged")], by_key[(workload, batch, "transformers")]
        row = {
            "workload": workload,
            "batch": batch,
            "paged_prefill_tok_s": round(paged.prefill_tok_s, 1),
            "transformers_prefill_tok_s": round(dense.prefill_tok_s, 1),
            "prefill_ratio": round(paged.prefill_tok_s / dense.prefill_tok_s, 2),
            "paged_decode_tok_s": round(paged.decode_tok_s, 1),
            "transformers_decode_tok_s": round(dense.decode_tok_s, 1),
            "decode_ratio": round(paged.decode_tok_s / dense.decode_tok_s, 2),
            "greedy_outputs_identical": agreement[f"{workload}/{batch}"],
        }
        rows.append(row)
        table.append(list(row.values()))
    print(markdown_table(list(rows[0]), table))
    return rows


def cpu_benchmark(quick: bool, threads: int) -> None:
    torch.set_num_threads(threads)
    settings = ExecutorSettings(
        model=str(PRESET),
        load_format="dummy",
        dtype="float32",  # the dense reference below is float32
        seed=0,
        kv_cache_memory=512 * 2**20,
        swap_space=0.0,
        max_num_batched_tokens=4096,
    )
    runner = build_runner(settings)
    config = AutoConfig.from_pretrained(PRESET)
    dense = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    dense.load_state_dict(runner.loaded.model.state_dict())
    dense.generation_config.eos_token_id = None
    dense.generation_config.pad_token_id = 0
    # --quick: one repetition, 8 new tokens, prompts at a quarter length (a smoke run).
    num_new, repeat, scale = (8, 1, 0.25) if quick else (32, 5, 1.0)
    results, agreement = measure(runner, dense, [1, 16, 64], num_new, repeat, scale)
    rows = report(results, agreement)
    path = write_results(
        "executor_cpu",
        {
            "model": "small-llama (dummy, seed 0, float32)",
            "threads": threads,
            "new_tokens": num_new,
            "repetitions": repeat,
            "quick": quick,
            "prompt_length_scale": scale,
            "rows": rows,
            "samples": [asdict(m) for m in results],
        },
    )
    print(f"\nwrote {path.relative_to(ROOT)}")


def _cuda_seconds(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def gpu_benchmark(batch: int = 128, context: int = 4096, block_size: int = 16) -> None:
    """FlashInfer paged decode attention, one layer of Llama-3-8B shapes, bf16, on CUDA.

    Achieved bandwidth = the cached K and V bytes the step reads / kernel time, against the
    measured device copy bandwidth; parity = max |flashinfer - torch backend| on the same step.
    """
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (torch.cuda.is_available() is False)")
    from executor_svc.attention import AttentionShape, SeqSpan, plan_step
    from executor_svc.attention.flashinfer_backend import FlashInferBackend
    from executor_svc.attention.torch_backend import TorchBackend
    from executor_svc.kv_cache import KVCache, KVCacheSpec

    device, dtype = torch.device("cuda"), torch.bfloat16
    config = AutoConfig.from_pretrained(ROOT / "models" / "llama3-8b-shapes")
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, 128
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, dtype)
    pages = context // block_size
    cache = KVCache.allocate(spec, batch * pages, 0, device)
    cache.kv.normal_()
    order = torch.randperm(batch * pages).tolist()  # scattered physical blocks
    spans = tuple(
        SeqSpan(i, 1, context, tuple(order[i * pages : (i + 1) * pages])) for i in range(batch)
    )
    query = torch.randn(1, heads, batch, head_dim, device=device, dtype=dtype)  # [1, Hq, B, D]
    key = torch.randn(1, kv_heads, batch, head_dim, device=device, dtype=dtype)  # [1, Hkv, B, D]
    value = torch.randn_like(key)  # [1, Hkv, B, D]
    scale = head_dim**-0.5
    backend = FlashInferBackend(device)
    shape = AttentionShape(heads, scale)
    step = plan_step(backend, spans, block_size, cache, shape)
    got = step.forward(0, query, key, value, scale)  # [1, B, Hq, D]
    want = plan_step(TorchBackend(), spans, block_size, cache, shape).forward(
        0, query, key, value, scale)
    max_err = (got.float() - want.float()).abs().max().item()
    paged = cache.layer(0)
    q = query[0].transpose(0, 1).contiguous()  # [B, Hq, D]
    kernel_s = _cuda_seconds(lambda: backend.decode_wrapper.run(q, paged), 50)
    layer_s = _cuda_seconds(lambda: step.forward(0, query, key, value, scale), 20)
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_bw = 2 * source.numel() / _cuda_seconds(lambda: target.copy_(source), 10)
    kv_bytes = batch * context * 2 * kv_heads * head_dim * cache.kv.element_size()
    row = {
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "decode_kernel_us": round(kernel_s * 1e6, 1),
        "achieved_TBps": round(kv_bytes / kernel_s / 1e12, 3),
        "copy_TBps": round(copy_bw / 1e12, 3),
        "fraction_of_copy_bw": round(kv_bytes / kernel_s / copy_bw, 3),
        "layer_with_append_us": round(layer_s * 1e6, 1),
        "max_abs_err_vs_torch": max_err,
        "device": torch.cuda.get_device_name(),
    }
    print(markdown_table(list(row), [list(row.values())]))
    path = write_results("executor_gpu", {"rows": [row]})
    print(f"\nwrote {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared box)"
    )
    parser.add_argument("--gpu", action="store_true", help="FlashInfer decode bandwidth (CUDA)")
    args = parser.parse_args()
    configure_logging("executor_bench", level="warning")  # no per-step events while timing
    if args.gpu:
        gpu_benchmark()
        return
    cpu_benchmark(args.quick, args.threads)


if __name__ == "__main__":
    main()
