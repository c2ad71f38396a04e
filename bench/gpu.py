"""GPU benchmark and checks, a prepared script for a lent GPU machine: NOT part of bench.run.

    python -m bench.gpu [--stage kernel,e2e,parity,memory] [--quick] [--out DIR]

Needs CUDA, and FlashInfer for every stage but parity's fp32 half (on the lent machine: the
kit of tools/gpu_check.sh, which runs each stage on its own). Each stage writes its JSON
(gpu_<stage>.json) under --out as soon as it ends (default bench/results; on the lent machine
a folder under $OUT, the only place whose files come back).

- kernel: decode attention bandwidth. The executor's FlashInfer backend on one layer of
  Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block 16, scattered
  blocks) for batch 32/64 and context 2048/4096/8192: decode kernel time, the KV bytes it must
  read, achieved bandwidth as a share of a measured 1 GiB device copy (read + write). Target
  >= 0.8 at context >= 2048, batch >= 32. Also the whole layer (append + decode) and the max
  difference against the torch backend.
- e2e: decode throughput. The three services (executor `--device cuda --backend flashinfer
  --dtype bfloat16 --load-format dummy`) on Llama-3-8B shapes cut to --layers layers serve B
  requests of P random prompt tokens -> N new (greedy); then transformers `generate` runs the
  same prompts as one static batch on the same GPU with the same dummy weights (bf16, sdpa).
  Output tok/s, decode tok/s (B / TPOT), and first-16-token agreement.
- parity: the whole stack on CUDA against transformers on CUDA, greedy, prompts of mixed
  lengths sharing prefixes, chunked prefill: fp32 with the torch backend (tiny-llama: must be
  token-identical) and bf16 with FlashInfer (tiny-llama-hd128, the kernels' head_dim:
  agreement reported, as bf16 rounding parts ways after near-ties).
- memory: is the pool sized right? The executor with --gpu-memory-utilization U on the cut
  8B shapes: its profile (the executor's log), the pool's blocks (allocated at start), the
  device's used share after start and at its peak while the largest steps run (8,192-token
  prefills, 1,024-row decodes; polled from this process); the share must stay under U and no
  request may fail.

The 8B shapes are cut to --layers (default 8) layers: drawing dummy weights on the CPU (so that
every device gets the same ones) costs about 5 ns a parameter, 40 s for all 32 layers.
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

    from executor_svc.attention import AttentionShape, SeqSpan, plan_step
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
    query = torch.randn(1, heads, batch, head_dim, device=device, dtype=dtype)
    key = torch.randn(1, kv_heads, batch, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    scale = head_dim ** -0.5
    backend = FlashInferBackend(device)
    shape = AttentionShape(heads, scale)
    step = plan_step(backend, spans, block_size, cache, shape)
    got = step.forward(0, query, key, value, scale)
    max_err = None
    if batch * context <= 64 * 4096:  # the torch reference gathers everything: keep it small
        want = plan_step(TorchBackend(), spans, block_size, cache, shape).forward(
            0, query, key, value, scale)
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


def _print_log_tails(log_dir: str, lines: int = 40) -> None:
    """The services' last log lines, into this stage's output: on the lent machine only what
    is under $OUT comes back, and a failed stack's traceback is in its logs."""
    for path in sorted(Path(log_dir).glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"---- {path.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)


def _tokenizer_preset(num_layers: int) -> str:
    """The 8B-shapes config cut to `num_layers` layers, with a tokenizer beside it (the
    gateway loads one)."""
    path = Path(tempfile.mkdtemp(prefix="pagedkv-8b-"))
    for source in (ROOT / MODEL).iterdir():
        shutil.copy(source, path / source.name)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ROOT / TOKENIZER_FROM / name).exists():
            shutil.copy(ROOT / TOKENIZER_FROM / name, path / name)
    return str(path)


def e2e(batch: int, prompt_len: int, output_len: int, num_layers: int) -> dict[str, Any]:
    import random
    import statistics

    import torch

    from bench.baselines import BenchRequest, reference_model
    from bench.load import run_load, stack

    rng = random.Random(SEED)
    reqs = [BenchRequest([1, *(rng.randrange(3, 32000) for _ in range(prompt_len - 1))],
                         output_len) for _ in range(batch)]
    row: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "output_len": output_len,
                           "num_layers": num_layers}
    preset = _tokenizer_preset(num_layers)
    executor_args = ("--device", "cuda", "--backend", "flashinfer", "--dtype", "bfloat16",
                     "--gpu-memory-utilization", "0.6", "--max-num-seqs", "512",
                     "--max-num-batched-tokens", "16384")
    gateway_args = ("--max-num-seqs", "512", "--max-num-batched-tokens", "16384")
    log_dir = tempfile.mkdtemp(prefix="pagedkv-e2e-")
    try:
        with stack(preset, executor_args=executor_args, gateway_args=gateway_args,
                   seed=SEED, log_dir=log_dir) as running:
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
        _print_log_tails(log_dir)
    try:
        from transformers import GenerationConfig

        # the executor's recipe: seeded init in bf16 on the CPU, then moved
        model = reference_model(preset, SEED, attn="sdpa", dtype=torch.bfloat16).to("cuda")
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


PARITY_RUNS = (
    # (name, model, dtype, backend, identical required)
    ("fp32_torch", "models/tiny-llama", "float32", "torch", True),
    ("bf16_flashinfer", "models/tiny-llama-hd128", "bfloat16", "flashinfer", False),
)


def parity_requests(vocab: int, num: int = 24, output_len: int = 48) -> list[Any]:
    """Prompts of 3 to 300 tokens, half of them sharing a 64-token prefix (prefix hits)."""
    import random

    from bench.baselines import BenchRequest

    rng = random.Random(SEED)
    shared = [1, *(rng.randrange(3, vocab) for _ in range(63))]
    requests = []
    for i in range(num):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 300))]
        prompt = shared + body if i % 2 else [1, *body]
        requests.append(BenchRequest(prompt, output_len))
    return requests


def stack_parity() -> dict[str, Any]:
    """Greedy outputs of the stack on CUDA against transformers' generate on CUDA."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    from bench.baselines import reference_model
    from bench.load import run_load, stack

    payload: dict[str, Any] = {}
    for name, model_dir, dtype, backend, must_match in PARITY_RUNS:
        row: dict[str, Any] = {"model": model_dir, "dtype": dtype, "backend": backend}
        payload[name] = row
        log_dir = ""
        try:
            vocab = AutoConfig.from_pretrained(ROOT / model_dir).vocab_size
            reqs = parity_requests(vocab)
            executor_args = ("--device", "cuda", "--dtype", dtype, "--backend", backend,
                             "--gpu-memory-utilization", "0.3",
                             "--max-num-batched-tokens", "256")  # chunked prefill
            gateway_args = ("--max-num-batched-tokens", "256")
            log_dir = tempfile.mkdtemp(prefix=f"pagedkv-parity-{name}-")
            with stack(str(ROOT / model_dir), executor_args=executor_args,
                       gateway_args=gateway_args, seed=SEED, log_dir=log_dir) as running:
                results, _ = run_load(running.gateway_addr, reqs, len(reqs))
            got = [list(r.tokens) for r in results]
            model = reference_model(model_dir, SEED, attn="sdpa",
                                    dtype=getattr(torch, dtype)).to("cuda")
            config = GenerationConfig(do_sample=False, pad_token_id=0, eos_token_id=None,
                                      max_new_tokens=reqs[0].output_len)
            want = []
            with torch.inference_mode():
                for r in reqs:
                    out = model.generate(torch.tensor([r.prompt], device="cuda"),
                                         generation_config=config)
                    want.append(out[0, len(r.prompt):].tolist())
            same = sum(a == b for a, b in zip(got, want, strict=True))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                               len(b))
                      for a, b in zip(got, want, strict=True)]
            pairs = list(zip(got, want, strict=True))
            row.update(requests=len(reqs), identical=same,
                       first16_identical=sum(a[:16] == b[:16] for a, b in pairs),
                       mean_agreeing_prefix=sum(prefix) / len(prefix),
                       errors=sorted({r.error for r in results if not r.ok})[:3])
            if must_match:
                row["ok"] = same == len(reqs)
            del model
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - keep the other run's figures
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if log_dir:
                _print_log_tails(log_dir)
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    return payload


def memory_profile(num_layers: int, utilization: float = 0.9) -> dict[str, Any]:
    """The pool --gpu-memory-utilization gives, and the device's use while a load fills it."""
    import random
    import threading

    import torch

    from bench.baselines import BenchRequest
    from bench.load import pool_stats, run_load, stack

    free, total = torch.cuda.mem_get_info()  # this process's context first: the executor counts it
    row: dict[str, Any] = {"utilization": utilization, "num_layers": num_layers,
                           "total_bytes": total, "used_before_start": (total - free) / total}
    preset = _tokenizer_preset(num_layers)
    log_dir = tempfile.mkdtemp(prefix="pagedkv-memory-")
    peak = [0.0]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            free_now, _ = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], (total - free_now) / total)
            time.sleep(0.02)

    rng = random.Random(SEED)
    # 1,024 sequences: the pool is not capped by what they can use (1,024 x 8,192 tokens is
    # more than the budget holds), the largest steps run (8,192-token prefills, 1,024-row
    # decodes whose logits and sampling the profile must have counted).
    reqs = [BenchRequest([1, *(rng.randrange(3, 32000) for _ in range(1023))], 32)
            for _ in range(1024)]
    executor_args = ("--device", "cuda", "--backend", "flashinfer", "--dtype", "bfloat16",
                     "--gpu-memory-utilization", str(utilization), "--max-num-seqs", "1024",
                     "--max-num-batched-tokens", "8192")
    gateway_args = ("--max-num-seqs", "1024", "--max-num-batched-tokens", "8192")
    try:
        with stack(preset, executor_args=executor_args, gateway_args=gateway_args, seed=SEED,
                   log_dir=log_dir) as running:
            free_now, _ = torch.cuda.mem_get_info()
            row["used_after_start"] = (total - free_now) / total
            (pool,) = pool_stats(running)
            row["num_blocks"] = pool.num_blocks
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            results, wall = run_load(running.gateway_addr, reqs, len(reqs))
            stop.set()
            poller.join()
        row.update(peak_used=peak[0], completed=sum(r.ok for r in results), wall_s=wall,
                   errors=sorted({r.error for r in results if not r.ok})[:3])
        row["ok"] = row["completed"] == len(reqs) and peak[0] <= utilization + 0.01
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        _print_log_tails(log_dir)
    finally:
        stop.set()
    for line in (Path(log_dir) / "executor.log").read_text().splitlines() if (
            Path(log_dir) / "executor.log").exists() else []:
        if any(event in line for event in ("gpu_memory_profiled", "kv_cache_allocated",
                                           "kv_blocks_capped")):
            row.setdefault("executor_log", []).append(line[-600:])
    shutil.rmtree(preset, ignore_errors=True)
    return row


STAGES = ("kernel", "e2e", "parity", "memory")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default=",".join(STAGES),
                   help=f"comma-separated stages, in the order given: {', '.join(STAGES)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes, one e2e size")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for gpu_<stage>.json (default bench/results)")
    p.add_argument("--layers", type=int, default=8,
                   help="layers of the 8B shapes for the e2e and memory stages")
    p.add_argument("--batches", default="32,64")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--e2e", default="64x512x256",
                   help="comma-separated BATCHxPROMPTxOUTPUT end-to-end sizes")
    args = p.parse_args(argv)
    stages = [s for s in args.stage.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(STAGES)}")
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA device (run it on the lent GPU machine)", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    common = {"benchmark": "gpu", "seed": SEED, "device": torch.cuda.get_device_name(),
              "quick": args.quick}
    for stage in stages:
        payload = {**common, "stage": stage}
        if stage == "kernel":
            payload.update(kernel_stage(args))
        elif stage == "e2e":
            sizes = args.e2e.split(",")[:1] if args.quick else args.e2e.split(",")
            payload["e2e"] = []
            for size in sizes:
                batch, prompt_len, output_len = (int(x) for x in size.split("x"))
                payload["e2e"].append(e2e(batch, prompt_len, output_len, args.layers))
                print(json.dumps(payload["e2e"][-1], default=str), file=sys.stderr, flush=True)
            print_e2e(payload["e2e"])
        elif stage == "parity":
            payload["parity"] = stack_parity()
        else:
            payload["memory"] = memory_profile(args.layers)
        path = write_results(f"gpu_{stage}", payload, args.out)
        print(f"{stage}: written to {path}", flush=True)
    return 0


def kernel_stage(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        batches, contexts = batches[:1], contexts[:2]
    payload: dict[str, Any] = {"model": MODEL}
    rows: list[dict[str, Any]] = []
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
    return payload


def print_e2e(rows: list[dict[str, Any]]) -> None:
    body = []
    for r in rows:
        for system in ("pagedkv", "generate"):
            m = r.get(system, {})
            body.append([f"{r['batch']}x{r['prompt_len']}->{r['output_len']}", system,
                         f"{m['tok_per_s']:.0f}" if "tok_per_s" in m else m.get("error"),
                         f"{m['decode_tok_per_s']:.0f}" if "decode_tok_per_s" in m else "-"])
    print("### End-to-end decode throughput on the GPU\n")
    print(markdown_table(["requests", "system", "tok/s", "decode tok/s"], body))


if __name__ == "__main__":
    raise SystemExit(main())
