"""KV blocks held by beam search, with block sharing (copy-on-write) and without.

    python -m bench.beam_search [--quick] [--model DIR] [--widths 2,3,4,5,6]

The whole stack (`make run`'s three services) on the embedded SmolLM2-135M-Instruct with its
real weights (a preset's directory: seeded dummy weights). Alpaca-like requests, as the
PagedAttention paper's beam-search figure (its 37.6-55.2% saving at widths 2-6 is OPT-13B on
Alpaca): short instructions, each output as long as an Alpaca-like length drawn from
bench/workloads.py, fixed by `ignore_eos` (the trace's lengths, as the paper replays them).
One search at a time, over gRPC (use_beam_search, beam_width, n 1).

Two counts, both exact, from the allocator's own allocation recording
(`--record-allocations`: one line per Step, with the requests it scheduled and the pool's
blocks in use after it):
- shared: at every step of a search, the pool's blocks in use after its Step. One search runs
  at a time, alone in the pool, so these are the distinct blocks of its running beams' tables
  (the prompt's blocks, and the common prefix of the beams' outputs, are held once; a fork
  copies only the partial last block; a pruned beam is freed before the next Step schedules);
- unshared: the same beams, each holding its own copy of every block of its table (the same
  search without sharing): at step k every beam has computed the prompt and k - 1 generated
  tokens, so beams x ceil((prompt + k - 1) / block_size).
Each search's Steps start with the one that admits its first beam; the script checks that
nothing else was admitted, deferred or preempted meanwhile.

Saving = 1 - (block-steps shared) / (block-steps unshared), over all of a width's searches;
also per search (mean) and at the peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch  # noqa: F401 - imported for the machine description (bench.common)
from tqdm import tqdm

from bench.common import markdown_table, write_results
from bench.load import stack
from bench.workloads import ALPACA, sample_lengths
from common.model_dirs import DEFAULT_MODEL, ModelDir
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc

SEED = 0
BLOCK_SIZE = 16
PAPER = {"model": "OPT-13B", "trace": "Alpaca", "saving": "37.6-55.2% at beam widths 2-6"}
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


@dataclass(frozen=True, slots=True)
class SearchSteps:
    """One search's Steps at the allocator: its prompt's length and, per Step, the requests it
    scheduled (the running beams) and the pool's blocks in use after it."""

    num_prompt_tokens: int
    rows: tuple[int, ...]
    used: tuple[int, ...]

    def unshared(self, block_size: int) -> list[int]:
        """Per step, the blocks of the beams' tables summed (at step k, k - 1 generated)."""
        return [rows * -(-(self.num_prompt_tokens + k) // block_size)
                for k, rows in enumerate(self.rows)]


def recorded_searches(path: Path) -> list[SearchSteps]:
    """The recording's Steps, split into searches, in order: each starts with the Step that
    admits its first beam. One search at a time and a pool that holds it, or the counts are
    not one search's: checked."""
    searches: list[SearchSteps] = []
    prompt: int | None = None
    rows: list[int] = []
    used: list[int] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("k") != "step":
            continue  # the header, Free, Fork
        assert not record.get("pre") and not record.get("wait"), f"room was short: {record}"
        admitted = record.get("admit", [])
        if admitted:
            assert len(admitted) == 1, f"two searches at once: {record}"
            if prompt is not None:
                searches.append(SearchSteps(prompt, tuple(rows), tuple(used)))
            prompt, rows, used = admitted[0][1], [], []
        assert prompt is not None, f"a Step before any admission: {record}"
        rows.append(record["rows"])
        used.append(record["used"])
    if prompt is not None:
        searches.append(SearchSteps(prompt, tuple(rows), tuple(used)))
    return searches


def tally(steps: SearchSteps, block_size: int) -> dict[str, int]:
    unshared = steps.unshared(block_size)
    return {"num_steps": len(steps.used), "peak_blocks": max(steps.used),
            "peak_blocks_unshared": max(unshared), "sum_blocks": sum(steps.used),
            "sum_blocks_unshared": sum(unshared)}


def search(stub: gpb_grpc.GatewayServiceStub, text: str, width: int, max_tokens: int
           ) -> tuple[int, list[int], float]:
    request = gpb.CompleteRequest(text=text, sampling=gpb.SamplingParams(
        max_tokens=max_tokens, use_beam_search=True, beam_width=width, n=1, ignore_eos=True))
    start = time.perf_counter()
    response = stub.Complete(request, timeout=1800)
    completion = response.completions[0]
    return (completion.usage.prompt_tokens, list(completion.token_ids),
            time.perf_counter() - start)


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
    gateway_args = ("--max-beam-width", str(max(widths)))
    recording = Path(tempfile.mkdtemp(prefix="pagedkv-beam-search-")) / "allocations.jsonl"
    runs: dict[int, list[dict[str, Any]]] = {}
    with stack(args.model, seed=SEED, load_format=load_format, gateway_args=gateway_args,
               executor_args=("--block-size", str(BLOCK_SIZE)),
               allocator_args=("--record-allocations", str(recording))) as running:
        with grpc.insecure_channel(running.gateway_addr) as channel:
            stub = gpb_grpc.GatewayServiceStub(channel)
            search(stub, "Warm up.", 2, 4)
            bar = tqdm(total=len(widths) * len(texts), desc="beam search", file=sys.stderr)
            for width in widths:
                for text, max_tokens in zip(texts, lengths, strict=True):
                    num_prompt, tokens, seconds = search(stub, text, width, max_tokens)
                    runs.setdefault(width, []).append({
                        "text": text, "prompt_tokens": num_prompt, "max_tokens": max_tokens,
                        "num_tokens": len(tokens), "seconds": seconds,
                    })
                    bar.update(1)
            bar.close()
    # The stack has stopped: the recording is complete. The first search is the warm-up.
    searches = recorded_searches(recording)[1:]
    ordered = [run for width in widths for run in runs[width]]
    assert len(searches) == len(ordered), f"{len(searches)} searches recorded, {len(ordered)} run"
    for run, steps in zip(ordered, searches, strict=True):
        assert steps.num_prompt_tokens == run["prompt_tokens"], "searches out of order"
        run.update(tally(steps, BLOCK_SIZE))
    rows = [summarize(width, runs[width]) for width in widths]
    table = markdown_table(
        ["beam width", "searches", "mean blocks shared", "mean blocks unshared", "saving",
         "per search", "peak shared / unshared (max)"],
        [[r["beam_width"], r["searches"], f"{r['mean_blocks']:.1f}",
          f"{r['mean_blocks_unshared']:.1f}", f"{r['saving']:.1%}",
          f"{r['saving_per_search_min']:.1%}-{r['saving_per_search_max']:.1%}",
          f"{r['peak_blocks_max']} / {r['peak_blocks_unshared_max']}"] for r in rows])
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
