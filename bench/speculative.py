"""Speculative decoding (prompt lookup) against none, same run: where drafting pays, and where
it must not cost.

    python -m bench.speculative [--repeats 3] [--k 4] [--dtype float32]

The embedded SmolLM2-135M-Instruct with its real weights (greedy, ignore_eos), the whole
stack, for each repeat a fresh stack per configuration, their order reversed every other
repeat. Workloads:
  copy     chat requests asking to repeat a passage of a fixed text (the presets' tokenizer
           corpus: the project's design notes) word for word (the output copies its
           prompt, as summaries, extractions and code edits do), 128 output tokens: 4 at
           concurrency 1, 16 at concurrency 8
  random   bench.vs_vllm's mixed workload (64 requests of random token ids), concurrency 16:
           nothing in the prompts to copy (the model's own repetitions may be)
  sampled  the same requests sampled (temperature 0.8, seeded): never drafted for, they show
           what drafting costs the requests it cannot help
Two configurations: off (the defaults) and ngram (prompt lookup, `--k` tokens, lookups of 4
down to 2). Reported: output tok/s and the inter-token time per
request (medians over repeats, with each repeat's ratio to off), the gateway's steps (its
--step-log), the drafts it proposed and the executor accepted (vLLM's spec_decode metrics,
from /metrics), the mean acceptance length (1 + accepted / drafts: tokens a drafted row
emits) and whether every output equals the run without drafts (sampled ones too: seeded).
Writes
bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from bench.baselines import BenchRequest
from bench.common import markdown_table, percentile, write_results
from bench.load import read_steps, run_load, stack
from bench.vs_vllm import mixed_requests
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT

CONFIGS = ("off", "ngram")  # the defaults; drafting
COPY_OUTPUT = 128
# A fixed text (the tokenizer presets' corpus): passages from the docs would change the
# workload whenever the docs do.
SOURCE = "models/tokenizer_corpus.txt"
METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens")


def copy_requests(count: int) -> list[BenchRequest]:
    """Chat prompts that ask to repeat a passage of ~100 words of this repository's docs."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    words = (REPO_ROOT / SOURCE).read_text().split()
    out = []
    for i in range(count):
        passage = " ".join(words[i * 150:i * 150 + 100])
        messages = [{"role": "user", "content": "Repeat the following text exactly, word for "
                     f"word, and nothing else:\n\n{passage}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(BenchRequest(list(ids), COPY_OUTPUT))
    return out


def metrics(http: str) -> dict[str, float]:
    text = httpx.get(f"{http}/metrics", timeout=10).text
    values = {}
    for name in METRICS:
        match = re.search(rf"^{re.escape(name)}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values


def run_one(config: str, k: int, dtype: str,
            workloads: list[tuple[str, int, list[BenchRequest]]]) -> dict[str, Any]:
    step_log = tempfile.mktemp(prefix="pagedkv-spec-steps-")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    gateway_args = {"off": [], "ngram": ["--speculative-config", spec]}[config]
    out: dict[str, Any] = {"config": config, "runs": []}
    with stack(str(DEFAULT_MODEL), executor_args=["--dtype", dtype], load_format="auto",
               gateway_args=gateway_args, step_log=step_log) as running:
        http = f"http://127.0.0.1:{running.by_name('gateway').http_ports['--http-port']}"
        run_load(running.gateway_addr, mixed_requests(4, seed=99), 4)  # warm-up
        offset = read_steps(step_log)[1]
        for name, width, requests in workloads:
            before = metrics(http)
            results, wall = run_load(running.gateway_addr, requests, concurrency=width)
            steps, offset = read_steps(step_log, offset)
            after = metrics(http)
            ok = [r for r in results if r.ok]
            drafts, drafted, accepted = (after[m] - before[m] for m in METRICS)
            itl = [(r.last_s - r.first_s) / (len(r.tokens) - 1) for r in ok
                   if len(r.tokens) > 1]
            out["runs"].append({
                "workload": name, "concurrency": width, "completed": len(ok),
                "requests": len(results), "tok_per_s": sum(len(r.tokens) for r in ok) / wall,
                "itl_p50_ms": percentile(itl, 50) * 1e3 if itl else None,
                "steps": len(steps), "drafts": drafts, "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_length": 1 + accepted / drafts if drafts else None,
                "tokens": [r.tokens for r in results],
                "errors": sorted({r.error for r in results if not r.ok})[:3],
            })
    Path(step_log).unlink(missing_ok=True)
    return out


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["workload"], r["concurrency"]) for run in runs for r in run["runs"]},
                  key=lambda key: (("copy", "random", "sampled").index(key[0]), key[1]))
    for workload, width in keys:
        per: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
        for run in runs:
            per[run["config"]] += [r for r in run["runs"]
                                   if (r["workload"], r["concurrency"]) == (workload, width)]
        off, on = per["off"], per["ngram"]
        ratios = [b["tok_per_s"] / a["tok_per_s"] for a, b in zip(off, on, strict=True)]
        rows.append({
            "workload": workload, "concurrency": width,
            "off_tok_per_s": statistics.median(r["tok_per_s"] for r in off),
            "ngram_tok_per_s": statistics.median(r["tok_per_s"] for r in on),
            "ratios": [round(x, 3) for x in ratios], "ratio": statistics.median(ratios),
            "off_itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in off),
            "ngram_itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in on),
            "off_steps": statistics.median(r["steps"] for r in off),
            "ngram_steps": statistics.median(r["steps"] for r in on),
            "acceptance_length": statistics.median(r["acceptance_length"] or 1 for r in on),
            "acceptance_rate": statistics.median(
                r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0 for r in on),
            "completed": all(r["completed"] == r["requests"] for r in off + on),
            "identical": all(a["tokens"] == b["tokens"] for a in off for b in on),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="one repeat, fewer requests")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    copies = copy_requests(8 if args.quick else 16)
    random = mixed_requests(16 if args.quick else 64, seed=7)
    sampled = [replace(r, temperature=0.8, seed=i) for i, r in enumerate(random)]
    workloads = [("copy", 1, copies[:4]), ("copy", 8, copies), ("random", 16, random),
                 ("sampled", 16, sampled)]
    runs = []
    for repeat in range(1 if args.quick else args.repeats):
        order = CONFIGS if repeat % 2 == 0 else CONFIGS[::-1]
        for config in order:
            print(f"repeat {repeat}: {config}", file=sys.stderr, flush=True)
            runs.append(run_one(config, args.k, args.dtype, workloads))
    rows = summarise(runs)
    print(markdown_table(
        ["workload", "conc.", "off tok/s", "ngram tok/s", "ngram/off (each)", "ITL ms off/ngram",
         "steps off/ngram", "accept. length", "accept. rate", "identical"],
        [[r["workload"], r["concurrency"], f"{r['off_tok_per_s']:.1f}",
          f"{r['ngram_tok_per_s']:.1f}", f"{r['ratio']:.2f} ({' / '.join(map(str, r['ratios']))})",
          f"{r['off_itl_p50_ms']:.1f} / {r['ngram_itl_p50_ms']:.1f}",
          f"{r['off_steps']:.0f} / {r['ngram_steps']:.0f}", f"{r['acceptance_length']:.2f}",
          f"{r['acceptance_rate']:.2f}", r["identical"]] for r in rows]))
    for run in runs:
        for r in run["runs"]:
            r.pop("tokens")
    write_results("speculative", {"model": str(DEFAULT_MODEL), "dtype": args.dtype, "k": args.k,
                                  "repeats": args.repeats, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
