"""KV blocks held by beam search, with block sharing (copy-on-write) and without.

    python -m bench.beam_search [--quick] [--model DIR] [--widths 2,3,4,5,6]

The whole stack (`make run`'s three services) on the embedded SmolLM2-135M-Instruct with its
real weights (a preset's directory: seeded dummy weights). Alpaca-like requests, as the
PagedAttention paper's beam-search figure (its 37.6-55.2% saving at widths 2-6 is OPT-13B on
Alpaca): short instructions, each output as long as an Alpaca-like length drawn from
bench/workloads.py, fixed by `ignore_eos` (the trace's lengths, as the paper replays them).
One search at a time, over gRPC (use_beam_search, beam_width, n 1).

Two counts, both exact:
- shared: at every step of a search, the distinct blocks of its running beams' tables (what
  the pool holds for it: prompt blocks, and the common prefix of the beams' outputs, are held
  once; a fork copies only the partial last block);
- unshared: the same beams, each holding its own copy of every block of its table (the same
  search without sharing: sum over beams of ceil(tokens / block_size)).
The gateway counts both at each step from the block tables the allocator granted, and logs
them when the search ends (`beam_search_finished`); this script reads them from its log. As
a cross-check it samples the allocator's own `num_used_blocks` (GetStats) every few
milliseconds during each search: its peak also counts blocks between a prune and its Free.

Saving = 1 - (block-steps shared) / (block-steps unshared), over all of a width's searches;
also per search (mean) and at the peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch  # noqa: F401 - imported for the machine description (bench.common)
from tqdm import tqdm

from bench.common import markdown_table, write_results
from bench.load import stack
from bench.workloads import ALPACA, sample_lengths
from common.model_dirs import DEFAULT_MODEL, ModelDir
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

SEED = 0
BLOCK_SIZE = 16
PAPER = {"model": "OPT-13B", "trace": "Alpaca", "saving": "37.6-55.2% at beam widths 2-6"}
SAMPLE_EVERY_S = 0.01
# Alpaca-style instructions (written for this benchmark), sent as plain text: 18.8 tokens on
# average with SmolLM2's tokenizer, as the paper's Alpaca inputs (19).
INSTRUCTIONS = [
    "Give three tips for staying healthy while working from home during the long, dark winter "
    "months.",
    "Describe the structure of an atom, including the protons and neutrons in the nucleus and "
    "the electrons around it.",
    "Rewrite the following sentence in the passive voice: The committee approved the new "
    "budget for the school yesterday.",
    "Explain why the sky appears blue during the day but turns red and orange at sunset.",
    "Write a short story about a lonely robot who learns to paint landscapes in an old "
    "lighthouse.",
    "Summarize the main causes of the French Revolution in a few sentences for a history class.",
    "Generate a list of five creative names for a small coffee shop near a university campus.",
    "Classify the following animals as mammals or reptiles: dolphin, lizard, bat, crocodile, "
    "whale.",
    "Describe how a bill becomes a law in the United States, step by step.",
    "Translate the following sentence into French: Where is the nearest train station, and "
    "when does it open?",
    "What are the main benefits of learning a second language as an adult, and how should one "
    "start?",
    "Explain how photosynthesis works in simple terms that a ten-year-old could understand.",
]


class UsedBlocks:
    """The allocator's num_used_blocks for the pool, sampled on a thread of its own."""

    def __init__(self, running: Stack) -> None:
        self.channel = running.internal_auth.channel(running.allocator_addr)
        self.stub = apb_grpc.AllocatorServiceStub(self.channel)
        self.samples: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            pools = self.stub.GetStats(apb.GetStatsRequest(), timeout=10).pools
            self.samples.append(sum(p.num_used_blocks for p in pools))
            time.sleep(SAMPLE_EVERY_S)

    def __enter__(self) -> UsedBlocks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.channel.close()


def search(stub: gpb_grpc.GatewayServiceStub, text: str, width: int, max_tokens: int
           ) -> tuple[int, list[int], float]:
    request = gpb.CompleteRequest(text=text, sampling=gpb.SamplingParams(
        max_tokens=max_tokens, use_beam_search=True, beam_width=width, n=1, ignore_eos=True))
    start = time.perf_counter()
    response = stub.Complete(request, timeout=1800)
    completion = response.completions[0]
    return (completion.usage.prompt_tokens, list(completion.token_ids),
            time.perf_counter() - start)


def finished_events(log_path: Path) -> list[dict[str, Any]]:
    events = []
    for line in log_path.read_text().splitlines():
        if '"beam_search_finished"' in line:
            events.append(json.loads(line))
    return events


def summarize(width: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    shared = sum(r["sum_blocks"] for r in runs)
    unshared = sum(r["sum_blocks_unshared"] for r in runs)
    per_search = [1 - r["sum_blocks"] / r["sum_blocks_unshared"] for r in runs]
    peak = [1 - r["peak_blocks"] / r["peak_blocks_unshared"] for r in runs]
    return {
        "beam_width": width, "searches": len(runs),
        "mean_blocks": shared / sum(r["num_steps"] for r in runs),
        "mean_blocks_unshared": unshared / sum(r["num_steps"] for r in runs),
        "saving": 1 - shared / unshared,
        "saving_per_search_mean": statistics.mean(per_search),
        "saving_per_search_min": min(per_search), "saving_per_search_max": max(per_search),
        "peak_blocks_max": max(r["peak_blocks"] for r in runs),
        "peak_blocks_unshared_max": max(r["peak_blocks_unshared"] for r in runs),
        "peak_saving_mean": statistics.mean(peak),
        "allocator_peak_used_blocks_max": max(r["allocator_peak_used"] for r in runs),
        "allocator_mean_used_blocks": statistics.mean(r["allocator_mean_used"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.beam_search", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 requests per width, not 12")
    p.add_argument("--widths", default="2,3,4,5,6")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory")
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    texts = INSTRUCTIONS[: 6 if args.quick else len(INSTRUCTIONS)]
    lengths = [r.output_len for r in sample_lengths(ALPACA, len(texts), 512, seed=SEED)]
    load_format = "auto" if ModelDir.inspect(args.model).weight_files else "dummy"
    gateway_args = ("--log-json", "--max-beam-width", str(max(widths)))
    runs: dict[int, list[dict[str, Any]]] = {}
    with stack(args.model, seed=SEED, load_format=load_format, gateway_args=gateway_args,
               executor_args=("--block-size", str(BLOCK_SIZE))) as running:
        log_path = Path(running.spec.log_dir or ".") / "gateway.log"
        with grpc.insecure_channel(running.gateway_addr) as channel:
            stub = gpb_grpc.GatewayServiceStub(channel)
            search(stub, "Warm up.", 2, 4)
            bar = tqdm(total=len(widths) * len(texts), desc="beam search", file=sys.stderr)
            for width in widths:
                for text, max_tokens in zip(texts, lengths, strict=True):
                    seen = len(finished_events(log_path))
                    with UsedBlocks(running) as used:
                        num_prompt, tokens, seconds = search(stub, text, width, max_tokens)
                    time.sleep(0.2)  # the log line is written after the last response
                    event = finished_events(log_path)[seen]
                    runs.setdefault(width, []).append({
                        "text": text, "prompt_tokens": num_prompt, "max_tokens": max_tokens,
                        "num_tokens": len(tokens),
                        "seconds": seconds, **{k: event[k] for k in (
                            "num_steps", "peak_blocks", "peak_blocks_unshared", "sum_blocks",
                            "sum_blocks_unshared")},
                        "allocator_peak_used": max(used.samples, default=0),
                        "allocator_mean_used": statistics.mean(used.samples or [0]),
                        "allocator_samples": len(used.samples),
                    })
                    bar.update(1)
            bar.close()
    rows = [summarize(width, runs[width]) for width in widths]
    table = markdown_table(
        ["beam width", "searches", "mean blocks shared", "mean blocks unshared", "saving",
         "per search", "peak shared / unshared (max)", "allocator peak used"],
        [[r["beam_width"], r["searches"], f"{r['mean_blocks']:.1f}",
          f"{r['mean_blocks_unshared']:.1f}", f"{r['saving']:.1%}",
          f"{r['saving_per_search_min']:.1%}-{r['saving_per_search_max']:.1%}",
          f"{r['peak_blocks_max']} / {r['peak_blocks_unshared_max']}",
          r["allocator_peak_used_blocks_max"]] for r in rows])
    print(table)
    print(f"paper ({PAPER['model']}, {PAPER['trace']}): {PAPER['saving']}")
    path = write_results("beam_search", {
        "model": args.model, "load_format": load_format, "block_size": BLOCK_SIZE,
        "workload": repr(ALPACA), "seed": SEED, "ignore_eos": True, "paper": PAPER,
        "summary": rows, "runs": {str(w): runs[w] for w in widths}, "table": table,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
