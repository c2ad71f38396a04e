"""What structured output costs the executor: decode steps of a 64-request batch, plain and
constrained by a JSON schema, interleaved in one run on the embedded real model.

The runner runs in process (no gRPC): 64 chat prompts prefilled, then --steps decode steps of
the whole batch; each repeat runs the plain batch and the constrained one in turn (the order
reversed every other repeat). Reported: the median decode step (ms) of each, their ratio per
repeat, and the time the constrained steps spent filling and unpacking their masks
(grammar.mask_bias, timed around its calls), per step and per request.

    .venv/bin/python -m bench.structured_output --repeats 3

Writes bench/results/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer

from bench.common import markdown_table, write_results
from common.logging import configure_logging
from common.model_dirs import DEFAULT_MODEL
from common.structured_output import StructuredOutput
from executor_svc import grammar, sampler
from executor_svc.runner import ModelRunner, build_runner
from executor_svc.settings import ExecutorSettings
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest

BATCH = 64
# Long enough that no output completes within the measured steps.
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
QUESTIONS = ["List people with their name, age and city as JSON.",
             "Give me a JSON list of customers: name, age, city.",
             "Write JSON records of employees (name, age, city).",
             "Produce a JSON array describing travellers: name, age and city."]


class MaskClock:
    """Time spent in grammar.mask_bias (each row's mask filled, all unpacked)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        original = sampler.mask_bias

        def timed(grammars: Sequence[grammar.GrammarState], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
            start = time.perf_counter()
            out = original(grammars, vocab_size, device)
            self.seconds += time.perf_counter() - start
            return out

        sampler.mask_bias = timed


def run_batch(runner: ModelRunner, prompts: list[list[int]], constrained: bool, steps: int,
              tag: str, clock: MaskClock) -> dict[str, float]:
    """Prefill the batch, then `steps` decode steps; the median step and mask time."""
    block = runner.info.block_size
    free = list(range(runner.info.num_blocks))
    tables: dict[str, list[int]] = {}
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None
    seqs = []
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        tables[rid] = [free.pop() for _ in range(-(-(len(prompt) + steps + 1) // block))]
        seqs.append(SequenceWork(rid, tuple(prompt), 0, BlockTableDelta(0, tuple(tables[rid])),
                                 SamplingParams(num_prompt_tokens=len(prompt),
                                                structured_output=constraint), sample=True))
    last: dict[str, int] = {}
    for first in range(0, len(seqs), 16):  # under max_num_batched_tokens
        prefill = runner.execute(StepRequest(seqs=tuple(seqs[first:first + 16])))
        last.update((t.request_id, t.token_id) for t in prefill.tokens)
    lengths = {f"{tag}-{i}": len(p) for i, p in enumerate(prompts)}
    times, masks = [], []
    for step in range(steps):
        work = tuple(SequenceWork(rid, (last[rid],), lengths[rid] + step, sample=True)
                     for rid in last)
        clock.seconds = 0.0
        start = time.perf_counter()
        result = runner.execute(StepRequest(seqs=work))
        times.append((time.perf_counter() - start) * 1e3)
        masks.append(clock.seconds * 1e3)
        last = {t.request_id: t.token_id for t in result.tokens}
    runner.release(tuple(last))
    return {"step_ms": statistics.median(times), "mask_ms": statistics.median(masks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning")
    runner = build_runner(ExecutorSettings(model=args.model, dtype=args.dtype, num_blocks=1024))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts: list[list[int]] = [list(tokenizer.apply_chat_template(  # type: ignore[arg-type]
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for i in range(BATCH)]
    clock = MaskClock()
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "constrained": []}
    run_batch(runner, prompts, True, 2, "warm", clock)  # compiles the schema once
    for repeat in range(args.repeats):
        order = ["plain", "constrained"] if repeat % 2 == 0 else ["constrained", "plain"]
        for name in order:
            runs[name].append(run_batch(runner, prompts, name == "constrained", args.steps,
                                        f"{name}-{repeat}", clock))
    ratios = [c["step_ms"] / p["step_ms"] for p, c in zip(runs["plain"], runs["constrained"],
                                                           strict=True)]
    plain = statistics.median(r["step_ms"] for r in runs["plain"])
    constrained = statistics.median(r["step_ms"] for r in runs["constrained"])
    mask = statistics.median(r["mask_ms"] for r in runs["constrained"])
    print(markdown_table(
        ["batch", "plain step ms", "constrained step ms", "ratio (per repeat)", "mask ms/step",
         "mask us/request"],
        [[BATCH, f"{plain:.1f}", f"{constrained:.1f}",
          " ".join(f"{r:.3f}" for r in ratios), f"{mask:.2f}", f"{mask / BATCH * 1e3:.0f}"]]))
    payload: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "batch": BATCH,
                               "steps": args.steps, "schema": SCHEMA, "runs": runs,
                               "ratios": ratios, "plain_step_ms": plain,
                               "constrained_step_ms": constrained, "mask_ms_per_step": mask}
    print(f"wrote {write_results('structured_output', payload)}")


if __name__ == "__main__":
    main()
