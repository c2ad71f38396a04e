"""Plain completions, structured output and tool calls at once, under vLLM's own load
generator: `vllm bench serve` against pagedkv's HTTP API and vLLM CPU's OpenAI server.

    .venv/bin/python -m bench.loadgen_mix [--dtype bfloat16] [--repeats 2]

At each total concurrency (3 / 24 / 48), three `vllm bench serve` processes run at once
against one server, a third of the concurrency each: plain streamed completions (random
128-token prompts, 64 tokens, --ignore-eos), chat completions with a JSON schema
(response_format json_schema; the output ends where the object does, at most 64 tokens) and
chat completions that must call one of two tools (tool_choice required, at most 64 tokens).
Both servers render chats with the same template (models/chat_templates/hermes_tools.jinja,
--chat-template on both; vLLM also --tool-call-parser hermes, which `required` needs) and run
in their best configuration (vLLM: bench.vs_vllm's binding and preloads); the servers take
turns, the order reversed every other repeat. Reported per class: output tok/s, TTFT and ITL
p50 as vLLM's tool computes them; medians of the repeats, with per-repeat ratios of the total
output tok/s. Writes bench/results/loadgen_mix.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_results
from bench.load import stack
from bench.vs_vllm import vllm_missing, vllm_server
from bench.vs_vllm_serve import INPUT_LEN, OUTPUT_LEN, SERVED, run_bench_serve
from common.model_dirs import DEFAULT_MODEL, PRESETS_DIR

TEMPLATE = PRESETS_DIR / "chat_templates" / "hermes_tools.jinja"
# vLLM parses (and for `required`, constrains) tool calls only with a parser named: the
# template's format.
VLLM_TOOL_ARGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
CONCURRENCIES = (3, 24, 48)
PROMPTS_PER_SLOT = 4  # each class sends 4 prompts per unit of its concurrency
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                          "maximum": 120},
    "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}}}]
CLASSES: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    # name: (backend, endpoint, extra body, ignore EOS)
    "plain": ("openai", "/v1/completions", {}, True),
    # (vLLM's random dataset sends ignore_eos: true; a constrained output ends at its EOS,
    # and pagedkv refuses the two together.)
    "json_schema": ("openai-chat", "/v1/chat/completions", {"ignore_eos": False,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": SCHEMA}}},
                    False),
    "tools": ("openai-chat", "/v1/chat/completions",
              {"ignore_eos": False, "tools": TOOLS, "tool_choice": "required"}, False),
}
METRICS = ("output_throughput", "median_ttft_ms", "median_itl_ms", "completed")


def bench_class(base_url: str, name: str, concurrency: int, seed: int) -> dict[str, float]:
    backend, endpoint, extra, ignore_eos = CLASSES[name]
    result = run_bench_serve(base_url, PROMPTS_PER_SLOT * concurrency, [
        "--backend", backend, "--endpoint", endpoint, "--random-output-len", str(OUTPUT_LEN),
        "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--metric-percentiles", "50",
        # Each class's own ids: the runs are concurrent, and a request id in use is
        # refused (409), as the gateway's contract says.
        "--request-id-prefix", f"{name}-{seed}-",
        *(["--ignore-eos"] if ignore_eos else []),
        *(["--extra-body", json.dumps(extra)] if extra else [])])
    return {m: float(result[m]) for m in METRICS}


def mixed(base_url: str, total: int, seed: int) -> dict[str, dict[str, float]]:
    """The three classes at once, a third of the concurrency each."""
    each = max(total // len(CLASSES), 1)
    with ThreadPoolExecutor(len(CLASSES)) as pool:
        runs = {name: pool.submit(bench_class, base_url, name, each, seed) for name in CLASSES}
        return {name: run.result() for name, run in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen_mix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)))
    args = parser.parse_args()
    if vllm_missing():
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-loadgen-mix-"))
    rows: list[dict[str, Any]] = []
    template = ("--chat-template", str(TEMPLATE))
    with stack(str(DEFAULT_MODEL), executor_args=("--dtype", args.dtype), load_format="auto",
               gateway_args=("--served-model-name", SERVED, *template),
               log_dir=str(log_dir)) as running, \
            vllm_server(str(DEFAULT_MODEL), log_dir / "vllm-server.log", args.dtype, SERVED,
                        (*template, *VLLM_TOOL_ARGS)) as vllm_url:
        port = running.by_name("gateway").http_ports["--http-port"]
        urls = {"vllm": vllm_url.removesuffix("/v1"), "pagedkv": f"http://127.0.0.1:{port}"}
        for url in urls.values():  # warm-up: first-call paths, compiled grammars
            mixed(url, 3, seed=99)
        for total in map(int, args.concurrencies.split(",")):
            samples: dict[str, list[dict[str, dict[str, float]]]] = {"vllm": [], "pagedkv": []}
            for rep in range(args.repeats):
                order = ("vllm", "pagedkv") if rep % 2 == 0 else ("pagedkv", "vllm")
                for system in order:
                    print(f"[loadgen_mix] concurrency {total} rep {rep + 1}/{args.repeats}: "
                          f"{system}", file=sys.stderr, flush=True)
                    samples[system].append(mixed(urls[system], total, seed=rep))
            row: dict[str, Any] = {"concurrency": total, "samples": samples}
            for name in CLASSES:
                row[name] = {m: {s: statistics.median(r[name][m] for r in samples[s])
                                 for s in samples} for m in METRICS}
            totals = {s: [sum(r[n]["output_throughput"] for n in CLASSES) for r in samples[s]]
                      for s in samples}
            row["total_output_throughput"] = {
                s: statistics.median(v) for s, v in totals.items()} | {
                "ratios": [round(a / b, 3) for a, b in zip(totals["pagedkv"], totals["vllm"],
                                                           strict=True)]}
            rows.append(row)
    table = []
    for r in rows:
        for name in CLASSES:
            m = r[name]
            table.append([r["concurrency"], name,
                          f"{m['output_throughput']['pagedkv']:.1f} / "
                          f"{m['output_throughput']['vllm']:.1f}",
                          f"{m['median_ttft_ms']['pagedkv']:.0f} / "
                          f"{m['median_ttft_ms']['vllm']:.0f}",
                          f"{m['median_itl_ms']['pagedkv']:.1f} / "
                          f"{m['median_itl_ms']['vllm']:.1f}"])
        t = r["total_output_throughput"]
        table.append([r["concurrency"], "all", f"{t['pagedkv']:.1f} / {t['vllm']:.1f}",
                      "ratio " + " ".join(f"{x:.2f}" for x in t["ratios"]), ""])
    print(markdown_table(["concurrency", "class", "output tok/s pagedkv / vLLM",
                          "TTFT p50 ms", "ITL p50 ms"], table))
    write_results("loadgen_mix", {"model": DEFAULT_MODEL.name, "dtype": args.dtype,
                                  "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                                  "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
