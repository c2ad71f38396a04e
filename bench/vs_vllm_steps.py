"""The executor's steps in process against vLLM CPU's offline engine on the same shapes.

    .venv/bin/python -m bench.vs_vllm_steps [--repeats 3]

Where `bench.vs_vllm` compares whole systems, this asks whether the gap is in the model's
steps or around them. Same model (the embedded SmolLM2-135M, fp32), same prompts, greedy:
  prefill   16 prompts x 128 tokens, one output token: one step of 2,048 tokens in both
  decode N  N prompts of 160 tokens (N = 1, 16, 64): the time of one decode step of N
            sequences
pagedkv: the executor's ModelRunner in this process (two threads, malloc tuned as the executor
tunes it), timed around its steps (bench.fused_layers' helpers). vLLM: `LLM.generate` in its
own virtualenv, in its best configuration (bench.vs_vllm's), timed around the call; a decode
step is (generate with 1 + D tokens - generate with 1 token) / D, D = 16, so it includes
vLLM's own per-step work (scheduling, its engine process hand-over, detokenizing), its
contexts average 8 tokens longer than pagedkv's four timed steps (attention over ~5% more
keys), and the prefill row is the whole call. Interleaved, medians. Writes
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
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench import fused_layers  # noqa: E402
from bench.baselines import BenchRequest  # noqa: E402
from bench.common import markdown_table, write_results  # noqa: E402
from bench.vs_vllm import FIRST_ID, VLLM_PYTHON, VOCAB, VllmOffline, mixed_requests  # noqa: E402
from common.model_dirs import DEFAULT_MODEL  # noqa: E402
from executor_svc.runner import ModelRunner  # noqa: E402

DECODE_BATCHES = (1, 16, 64)
DECODE_TOKENS = 16


def _requests(seed: int, count: int, length: int, output_len: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(FIRST_ID, VOCAB) for _ in range(length)], output_len)
            for _ in range(count)]


def vllm_steps(vllm: VllmOffline, seed: int) -> dict[str, float]:
    prompts, length = fused_layers.PREFILL_PROMPTS, fused_layers.PREFILL_LEN
    out = {"prefill": vllm.generate(_requests(seed, prompts, length, 1))[1]}
    for batch in DECODE_BATCHES:
        base = _requests(seed * 10 + batch, batch, fused_layers.CONTEXT, 1)
        longer = _requests(seed * 10 + batch + 5, batch, fused_layers.CONTEXT, 1 + DECODE_TOKENS)
        one, many = vllm.generate(base)[1], vllm.generate(longer)[1]
        out[f"decode {batch}"] = (many - one) / DECODE_TOKENS
    return out


def pagedkv_steps(runner: ModelRunner, seed: int) -> dict[str, float]:
    out = {"prefill": fused_layers.prefill_seconds(runner, seed)}
    for batch in DECODE_BATCHES:
        out[f"decode {batch}"] = fused_layers.decode_seconds(runner, seed * 10 + batch, batch)[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_vllm_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print("vLLM CPU's virtualenv is missing: run `make bench-vllm` (it creates "
              ".venv-vllm)", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    runner = fused_layers.build(str(DEFAULT_MODEL))
    log = Path(tempfile.mkdtemp(prefix="pagedkv-vs-vllm-steps-")) / "vllm.log"
    vllm = VllmOffline(str(DEFAULT_MODEL), "float32", log)
    times: dict[str, dict[str, list[float]]] = {"vllm": {}, "pagedkv": {}}
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
    finally:
        vllm.close()
    rows = []
    for step in times["pagedkv"]:
        ours = statistics.median(times["pagedkv"][step]) * 1e3
        theirs = statistics.median(times["vllm"][step]) * 1e3
        rows.append({"step": step, "pagedkv_ms": round(ours, 1), "vllm_ms": round(theirs, 1),
                     "pagedkv/vllm": round(ours / theirs, 3)})
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    write_results("vs_vllm_steps", {
        "model": str(DEFAULT_MODEL), "threads": 2, "repeats": args.repeats,
        "decode_tokens": DECODE_TOKENS, "context": fused_layers.CONTEXT, "rows": rows,
        "samples_ms": {system: {step: [round(v * 1e3, 2) for v in values]
                                for step, values in steps.items()}
                       for system, steps in times.items()},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
