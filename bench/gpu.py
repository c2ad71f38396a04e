"""GPU benchmark (issue 5, part 6), a prepared script for a lent H200: NOT part of bench.run.

    python -m bench.gpu [--quick] [--skip-e2e] [--skip-kernel]

Needs CUDA and FlashInfer (on the lent machine: the bundle from ../shared/tools, see its
README; set it up first). Two parts, each stage guarded so one failure does not lose the rest,
results in bench/results/gpu.json:

1. Decode attention bandwidth. The executor's own FlashInfer backend
   (executor_svc.attention.flashinfer_backend) on one layer of Llama-3-8B shapes (32 query
   heads, 8 KV heads, head_dim 128, bf16, block 16, scattered physical blocks) for batch 32/64
   and context 2048/4096/8192: decode kernel time, the bytes it must read (sum over requests of
   2 x context x Hkv x D x 2 bytes), achieved bandwidth, and that as a share of the measured
   device copy bandwidth (1 GiB device-to-device copy, read + write). Target >= 0.8 at
   context >= 2048, batch >= 32. Also the whole layer step (append + decode) and the max
   difference against the torch reference backend.
2. End-to-end decode throughput. The three services (executor `--device cuda --backend
   flashinfer --dtype bfloat16 --load-format dummy` on models/llama3-8b-shapes) serve B
   requests of P random prompt tokens -> N new (greedy, ignore_eos) through the gateway; then
   the stack stops and transformers `generate` runs the same prompts as one static batch
   (no padding: equal lengths) on the same GPU with the same dummy weights (seeded init),
   bf16, sdpa. Reported: output tokens/s over the whole run, and decode tokens/s (B / TPOT).
   The gateway needs a tokenizer: a temporary preset dir holds the 8B-shapes config and
   small-llama's tokenizer (prompts are token ids; generated ids above that tokenizer's
   vocabulary only feed the text stream, which this benchmark ignores).

Sized for a few minutes of device time: --quick runs fewer shapes and one e2e size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_results

ROOT = Path(__file__).resolve().parents[1]
MODEL = "models/llama3-8b-shapes"
TOKENIZER_FROM = "models/small-llama"
SEED = 0


def _cuda_seconds(fn: Any, iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting the read and the write."""
    import torch

    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = _cuda_seconds(lambda: target.copy_(source), 20)
    return 2 * 2**30 / seconds


def decode_bandwidth(batch: int, context: int, copy_bw: float, block_size: int = 16
                     ) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from executor_svc.attention import SeqSpan, StepMetadata
    from executor_svc.attention.flashinfer_backend import FlashInferBackend
    from executor_svc.attention.torch_backend import TorchBackend
    from executor_svc.kv_cache import KVCache, KVCacheSpec

    device, dtype = torch.device("cuda"), torch.bfloat16
    config = AutoConfig.from_pretrained(ROOT / MODEL)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, dtype)
    pages = -(-context // block_size)
    cache = KVCache.allocate(spec, batch * pages, 0, device)
    cache.kv.normal_()
    gen = torch.Generator().manual_seed(SEED)
    order = torch.randperm(batch * pages, generator=gen).tolist()  # scattered blocks
    spans = tuple(SeqSpan(i, 1, context, tuple(order[i * pages:(i + 1) * pages]))
                  for i in range(batch))
    metadata = StepMetadata.build(spans, block_size, device)
    query = torch.randn(1, heads, batch, head_dim, device=device, dtype=dtype)
    key = torch.randn(1, kv_heads, batch, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    scale = head_dim ** -0.5
    backend = FlashInferBackend(device)
    step = backend.plan(metadata, cache)
    got = step.forward(0, query, key, value, scale)
    max_err = None
    if batch * context <= 64 * 4096:  # the torch reference gathers everything: keep it small
        want = TorchBackend().plan(metadata, cache).forward(0, query, key, value, scale)
        max_err = float((got.float() - want.float()).abs().max())
    paged = cache.layer(0)
    q = query[0].transpose(0, 1).contiguous()  # [B, Hq, D]
    kernel_s = _cuda_seconds(lambda: backend.decode_wrapper.run(q, paged), 100)
    layer_s = _cuda_seconds(lambda: step.forward(0, query, key, value, scale), 50)
    kv_bytes = batch * context * 2 * kv_heads * head_dim * cache.kv.element_size()
    achieved = kv_bytes / kernel_s
    row = {
        "batch": batch, "context": context, "kv_bytes": kv_bytes,
        "decode_kernel_us": round(kernel_s * 1e6, 2),
        "floor_us": round(kv_bytes / copy_bw * 1e6, 2),
        "achieved_TBps": round(achieved / 1e12, 3),
        "copy_TBps": round(copy_bw / 1e12, 3),
        "share_of_copy_bw": round(achieved / copy_bw, 3),
        "layer_step_us": round(layer_s * 1e6, 2),
        "max_abs_err_vs_torch": max_err,
    }
    return row


def _tokenizer_preset() -> str:
    """The 8B-shapes config with a tokenizer beside it (the gateway loads one)."""
    path = Path(tempfile.mkdtemp(prefix="pagedkv-8b-"))
    for source in (ROOT / MODEL).iterdir():
        shutil.copy(source, path / source.name)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ROOT / TOKENIZER_FROM / name).exists():
            shutil.copy(ROOT / TOKENIZER_FROM / name, path / name)
    return str(path)


def e2e(batch: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    import random
    import statistics

    import torch

    from bench.baselines import BenchRequest, reference_model
    from bench.load import run_load, stack

    rng = random.Random(SEED)
    reqs = [BenchRequest([1, *(rng.randrange(3, 32000) for _ in range(prompt_len - 1))],
                         output_len) for _ in range(batch)]
    row: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "output_len": output_len}
    preset = _tokenizer_preset()
    executor_args = ("--device", "cuda", "--backend", "flashinfer", "--dtype", "bfloat16",
                     "--gpu-memory-utilization", "0.6", "--max-num-seqs", "512",
                     "--max-num-batched-tokens", "16384")
    gateway_args = ("--max-num-seqs", "512", "--max-num-batched-tokens", "16384")
    try:
        with stack(preset, executor_args=executor_args, gateway_args=gateway_args,
                   seed=SEED) as running:
            run_load(running.gateway_addr, reqs[:4], 4)  # warm-up
            results, wall = run_load(running.gateway_addr, reqs, batch)
        ok = [r for r in results if r.ok]
        tpot = statistics.median(t for r in ok if (t := r.tpot_s) is not None)
        row["pagedkv"] = {
            "completed": len(ok), "wall_s": wall,
            "tok_per_s": sum(len(r.tokens) for r in ok) / wall,
            "decode_tok_per_s": batch / tpot, "tpot_ms": tpot * 1e3,
            "ttft_p50_ms": statistics.median(r.ttft_s for r in ok) * 1e3,
            "errors": sorted({r.error for r in results if not r.ok})[:3],
        }
        pagedkv_tokens = [r.tokens for r in results]
    except Exception as exc:  # noqa: BLE001 - keep the baseline and the kernel figures
        row["pagedkv"] = {"error": f"{type(exc).__name__}: {exc}"}
        pagedkv_tokens = None
        traceback.print_exc()
    try:
        from transformers import GenerationConfig

        with torch.device("cuda"):
            # the executor's recipe: seeded init in bf16 on the device itself
            model = reference_model(MODEL, SEED, attn="sdpa", dtype=torch.bfloat16)
        ids = torch.tensor([r.prompt for r in reqs], device="cuda")
        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids[:4, :16], generation_config=GenerationConfig(
                max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=config)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids),
                           generation_config=GenerationConfig(
                               max_new_tokens=1, do_sample=False, pad_token_id=0,
                               eos_token_id=None))
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
        generated = out[:, prompt_len:].tolist()
        row["generate"] = {
            "wall_s": wall, "tok_per_s": batch * output_len / wall,
            "decode_tok_per_s": batch * (output_len - 1) / max(1e-9, wall - prefill),
            "prefill_s": prefill,
        }
        if pagedkv_tokens is not None:
            # bf16: the two may part ways after near-ties; report the agreement, not a verdict
            row["first16_token_match"] = sum(a[:16] == b[:16] for a, b in
                                             zip(pagedkv_tokens, generated, strict=True)) / batch
        del model
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        row["generate"] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    if "tok_per_s" in row.get("pagedkv", {}) and "tok_per_s" in row.get("generate", {}):
        row["ratio_tok_per_s"] = row["pagedkv"]["tok_per_s"] / row["generate"]["tok_per_s"]
        row["ratio_decode"] = (row["pagedkv"]["decode_tok_per_s"]
                               / row["generate"]["decode_tok_per_s"])
    shutil.rmtree(preset, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes, one e2e size")
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--batches", default="32,64")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--e2e", default="64x512x256",
                   help="comma-separated BATCHxPROMPTxOUTPUT end-to-end sizes")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA device (run it on the lent GPU machine)", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    payload: dict[str, Any] = {"benchmark": "gpu", "model": MODEL, "seed": SEED,
                               "device": torch.cuda.get_device_name(), "quick": args.quick}
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        batches, contexts = batches[:1], contexts[:2]
    if not args.skip_kernel:
        rows = []
        try:
            copy_bw = copy_bandwidth()
            torch.cuda.empty_cache()
            payload["copy_TBps"] = copy_bw / 1e12
            for batch in batches:
                for context in contexts:
                    try:
                        rows.append(decode_bandwidth(batch, context, copy_bw))
                    except Exception as exc:  # noqa: BLE001
                        rows.append({"batch": batch, "context": context,
                                     "error": f"{type(exc).__name__}: {exc}"})
                        traceback.print_exc()
                    torch.cuda.empty_cache()
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001
            payload["kernel_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        payload["decode_attention"] = rows
        good = [r for r in rows if "share_of_copy_bw" in r]
        if good:
            keys = ["batch", "context", "decode_kernel_us", "floor_us", "achieved_TBps",
                    "copy_TBps", "share_of_copy_bw", "layer_step_us", "max_abs_err_vs_torch"]
            print("### Decode attention (FlashInfer backend, Llama-3-8B shapes, bf16)\n")
            print(markdown_table(keys, [[r[k] for k in keys] for r in good]))
            met = all(r["share_of_copy_bw"] >= 0.8 for r in good
                      if r["batch"] >= 32 and r["context"] >= 2048)
            payload["target_share_0_8_met"] = met
            print(f"\nTarget >= 0.8 of copy bandwidth (batch >= 32, context >= 2048): "
                  f"{'met' if met else 'MISSED'}\n")
        write_results("gpu", payload)  # keep the kernel figures even if e2e fails
    if not args.skip_e2e:
        sizes = args.e2e.split(",")[:1] if args.quick else args.e2e.split(",")
        payload["e2e"] = []
        for size in sizes:
            batch, prompt_len, output_len = (int(x) for x in size.split("x"))
            payload["e2e"].append(e2e(batch, prompt_len, output_len))
            print(json.dumps(payload["e2e"][-1], default=str), file=sys.stderr, flush=True)
        body = []
        for r in payload["e2e"]:
            for system in ("pagedkv", "generate"):
                m = r.get(system, {})
                body.append([f"{r['batch']}x{r['prompt_len']}->{r['output_len']}", system,
                             f"{m['tok_per_s']:.0f}" if "tok_per_s" in m else m.get("error"),
                             f"{m['decode_tok_per_s']:.0f}" if "decode_tok_per_s" in m else "-"])
        print("### End-to-end decode throughput on the GPU\n")
        print(markdown_table(["requests", "system", "tok/s", "decode tok/s"], body))
    path = write_results("gpu", payload)
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
