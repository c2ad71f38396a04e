"""The prefix cache's CPU tier: TTFT of a returning multi-turn conversation whose blocks were
evicted from the device pool, tier on vs off.

    python -m bench.cpu_tier [--quick] [--model DIR]

Two stacks run side by side, identical but for the executor's `--cpu-cache-space` (on: enough
CPU blocks for every conversation; off: 0), each with a small device pool (`--num-blocks`) and
no swap space. Per conversation: turn 1 (a `--turn-len` prompt, `--answer-len` greedy tokens),
then a flush prompt that shares nothing and fills the device pool (its blocks evict every
cached block of turn 1), then turn 2 (turn 1, its answer, `--user-len` new tokens; one output
token): its time to first token is what the figure reports. With the tier, turn 1's blocks
are copied back from CPU blocks; without, they are computed again. The same turn 2 without
the flush (turn 1's blocks still on the device) is the floor. Conversations alternate which
stack goes first; medians over conversations. Both stacks' outputs are compared token for
token. The model is small-llama (seeded dummy weights) by default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch  # noqa: F401 - imported for the machine description (bench.common)

from bench.baselines import BenchRequest
from bench.common import markdown_table, write_results
from bench.load import pool_stats, run_load, stack
from common.model_dirs import PRESETS_DIR
from tools.launch import Stack

SEED = 0
FIRST_ID = 3  # below: the presets' special tokens


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(count)]


def _one(running: Stack, prompt: list[int], output_len: int) -> tuple[list[int], float]:
    """Greedy output and time to first token (ms) of one request alone."""
    (result,), _ = run_load(running.gateway_addr, [BenchRequest(prompt, output_len)], 1)
    assert result.ok, result.error
    return result.tokens, result.ttft_s * 1e3


def _cpu_hits(running: Stack) -> int:
    return sum(p.num_prefix_cpu_hits for p in pool_stats(running))


def conversation(running: Stack, turn1: list[int], user: list[int], flush: list[int],
                 answer_len: int) -> dict[str, Any]:
    """Turn 1, the flush, turn 2 (timed); then turn 2 again with its blocks on the device."""
    answer, _ = _one(running, turn1, answer_len)
    _one(running, flush, 1)
    turn2 = turn1 + answer + user
    hits = _cpu_hits(running)
    out, ttft = _one(running, turn2, 1)
    cpu_tokens = _cpu_hits(running) - hits
    again, floor = _one(running, turn2 + user, 1)  # turn 2's blocks are on the device now
    return {"ttft_ms": ttft, "cpu_hit_tokens": cpu_tokens, "device_hit_ttft_ms": floor,
            "tokens": answer + out + again}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 conversations (default 8)")
    p.add_argument("--model", default=str(PRESETS_DIR / "small-llama"), help="model directory")
    p.add_argument("--turn-len", type=int, default=None, help="turn 1's prompt (1024; quick 768)")
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="device KV blocks (default: turn 1 + answer + 16 blocks)")
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="executor torch threads")
    args = p.parse_args(argv)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab, block_size = config["vocab_size"], 16
    turn_len = args.turn_len or (768 if args.quick else 1024)
    num_blocks = args.num_blocks or -(-(turn_len + args.answer_len) // block_size) + 16
    count = args.conversations or (4 if args.quick else 8)
    # The flush fills the whole pool; every conversation's blocks fit the tier, with room.
    flush_len = num_blocks * block_size - 8
    tier_gib = 2 * count * num_blocks * _bytes_per_block(config, block_size) / 2**30
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    common = ("--num-blocks", str(num_blocks), "--swap-space", "0")
    started = time.perf_counter()
    samples: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with stack(args.model, seed=SEED, executor_args=(*common, "--cpu-cache-space",
                                                     f"{tier_gib:.6f}")) as on, \
            stack(args.model, seed=SEED, executor_args=common) as off:
        stacks = {"on": on, "off": off}
        warm = _tokens(random.Random(-1), 64, vocab)
        for running in stacks.values():
            _one(running, warm, 2)
        for index in range(count):
            rng = random.Random(SEED + index)
            turn1, user = _tokens(rng, turn_len, vocab), _tokens(rng, args.user_len, vocab)
            flush = _tokens(rng, flush_len, vocab)
            for mode in ("on", "off") if index % 2 == 0 else ("off", "on"):
                samples[mode].append(conversation(stacks[mode], turn1, user, flush,
                                                  args.answer_len))
            print(f"conversation {index + 1}/{count}: on {samples['on'][-1]['ttft_ms']:.0f} ms, "
                  f"off {samples['off'][-1]['ttft_ms']:.0f} ms", file=sys.stderr)
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(samples["on"], samples["off"],
                                                          strict=True))
    med = {mode: {key: statistics.median(s[key] for s in samples[mode])
                  for key in ("ttft_ms", "cpu_hit_tokens", "device_hit_ttft_ms")}
           for mode in samples}
    speedup = med["off"]["ttft_ms"] / med["on"]["ttft_ms"]
    turn2_len = turn_len + args.answer_len + args.user_len
    rows = [
        ["off (recomputed)", f"{med['off']['ttft_ms']:.0f}", f"{med['off']['cpu_hit_tokens']:.0f}",
         f"{med['off']['device_hit_ttft_ms']:.0f}", ""],
        ["on (CPU tier)", f"{med['on']['ttft_ms']:.0f}", f"{med['on']['cpu_hit_tokens']:.0f}",
         f"{med['on']['device_hit_ttft_ms']:.0f}", f"{speedup:.1f}x"],
    ]
    print(f"### CPU tier: {Path(args.model).name}, turn 2 of {turn2_len} tokens after turn 1's "
          f"blocks were evicted ({num_blocks} device blocks), medians of {count}\n")
    print(markdown_table(["CPU tier", "turn-2 TTFT ms", "tokens from CPU",
                          "TTFT ms, blocks on device", "off/on"], rows))
    print(f"\nsame tokens on/off: {same}/{count}; {time.perf_counter() - started:.0f} s")
    write_results("cpu_tier", {
        "benchmark": "cpu_tier", "model": Path(args.model).name, "seed": SEED,
        "quick": args.quick, "turn_len": turn_len, "answer_len": args.answer_len,
        "user_len": args.user_len, "num_blocks": num_blocks, "flush_len": flush_len,
        "cpu_cache_space_gib": tier_gib, "conversations": count,
        "torch_threads": args.threads, "medians": med, "ttft_speedup": speedup,
        "same_tokens": same, "samples": {m: [{k: v for k, v in s.items() if k != "tokens"}
                                             for s in samples[m]] for m in samples},
    })
    return 0 if same == count else 1


def _bytes_per_block(config: dict[str, Any], block_size: int) -> int:
    """fp32 key and value of one block, all layers."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * block_size * heads * head_dim * 4


if __name__ == "__main__":
    raise SystemExit(main())
