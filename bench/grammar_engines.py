"""Grammar engines for structured output, side by side: compile time and per-token mask cost.

Each engine (llguidance, xgrammar, outlines-core) compiles the same JSON schemas for the
embedded model's tokenizer, then walks a valid instance of each schema token by token:
before every token it fills the next-token mask (what the executor's sampler does once per
generated token of a constrained request), checks that the instance's token is allowed, and
advances. Engines run in turn, the order reversed every other repeat; medians over repeats.
A 64-request batch (64 matchers, one schema each, round robin) gives the per-step cost.

    python -m venv /tmp/engines && /tmp/engines/bin/pip install torch==2.13.0 transformers \
        llguidance xgrammar outlines-core   # not into .venv: xgrammar brings triton (1 GB)
    /tmp/engines/bin/python -m bench.grammar_engines --repeats 3   # from the repository root

Each engine runs with its own JSON defaults. Engines that are not installed are skipped with a
line saying so. Writes bench/results/grammar_engines.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import markdown_table, write_results
from common.model_dirs import DEFAULT_MODEL

# (name, schema, a valid instance): a flat object, nesting with enums and arrays, a union.
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "email": {"type": "string"}},
        "required": ["name", "age", "email"], "additionalProperties": False,
    }, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    ("order", {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "note": {"type": ["string", "null"]},
        },
        "required": ["id", "status", "items", "note"], "additionalProperties": False,
    }, {"id": 1042, "status": "shipped",
        "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1,
                                                             "price": 120.25}],
        "note": None}),
    ("event", {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["click", "view"]},
            "target": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["kind", "target", "tags", "ok"], "additionalProperties": False,
    }, {"kind": "view", "target": 7, "tags": ["home", "mobile"], "ok": True}),
]
BATCH = 64


class Walk:
    """One engine's matcher for one schema: fill the mask, allow-check, advance."""

    fill: Callable[[], None]
    allowed: Callable[[int], bool]
    advance: Callable[[int], None]


def llguidance_engine(tokenizer: Any, vocab_size: int) -> Callable[[dict[str, Any]], Walk]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile_walk(schema: dict[str, Any]) -> Walk:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        walk = Walk()
        walk.fill = lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        walk.allowed = lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1)
        walk.advance = lambda t: _check(matcher.consume_token(t))
        return walk

    return compile_walk


def xgrammar_engine(tokenizer: Any, vocab_size: int) -> Callable[[dict[str, Any]], Walk]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_walk(schema: dict[str, Any]) -> Walk:
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        walk = Walk()
        walk.fill = lambda: matcher.fill_next_token_bitmask(mask, 0)
        walk.allowed = lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1)
        walk.advance = lambda t: _check(matcher.accept_token(t))
        return walk

    return compile_walk


def outlines_engine(tokenizer: Any, vocab_size: int) -> Callable[[dict[str, Any]], Walk]:
    import outlines_core

    vocabulary = _outlines_vocabulary(outlines_core, tokenizer)

    def compile_walk(schema: dict[str, Any]) -> Walk:
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        allowed: set[int] = set()
        walk = Walk()

        def fill() -> None:
            allowed.clear()
            allowed.update(guide.get_tokens())

        walk.fill = fill
        walk.allowed = lambda t: t in allowed
        walk.advance = lambda t: guide.advance(t)
        return walk

    return compile_walk


def _outlines_vocabulary(outlines_core: Any, tokenizer: Any) -> Any:
    """outlines-core's Vocabulary from the tokenizer's byte-level token strings."""
    eos = tokenizer.eos_token_id
    by_token: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos:
            by_token.setdefault(token, []).append(token_id)
    return outlines_core.Vocabulary(eos, by_token)


def _check(ok: Any) -> None:
    if ok is False:
        raise RuntimeError("the engine refused a token its mask allowed")


ENGINES = {"llguidance": ("llguidance", llguidance_engine),
           "xgrammar": ("xgrammar", xgrammar_engine),
           "outlines-core": ("outlines_core", outlines_engine)}


def measure(name: str, make: Callable[[dict[str, Any]], Walk], tokenizer: Any) -> dict[str, Any]:
    """Compile ms per schema, then us per mask over every instance's walk and for a batch."""
    compile_ms: list[float] = []
    mask_us: list[float] = []
    refused = 0
    for _, schema, instance in SCHEMAS:
        start = time.perf_counter()
        walk = make(schema)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        for token in tokenizer.encode(json.dumps(instance), add_special_tokens=False):
            start = time.perf_counter()
            walk.fill()
            mask_us.append((time.perf_counter() - start) * 1e6)
            if not walk.allowed(token):
                refused += 1
                break
            walk.advance(token)
    batch = [make(SCHEMAS[i % len(SCHEMAS)][1]) for i in range(BATCH)]
    start = time.perf_counter()
    for walk in batch:  # the first step of each: the widest masks (any key may start)
        walk.fill()
    batch_ms = (time.perf_counter() - start) * 1e3
    return {"engine": name, "compile_ms": statistics.median(compile_ms),
            "mask_us_median": statistics.median(mask_us), "mask_us_mean": statistics.mean(mask_us),
            "masks": len(mask_us), "batch64_ms": batch_ms, "refused_instance_tokens": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    torch.set_num_threads(1)
    engines = {}
    for name, (module, factory) in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            print(f"{name}: not installed, skipped (pip install {module})")
            continue
        engines[name] = factory(tokenizer, vocab_size)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            runs[name].append(measure(name, engines[name], tokenizer))
    keys = ("compile_ms", "mask_us_median", "mask_us_mean", "batch64_ms")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} | {
        "refused_instance_tokens": max(r["refused_instance_tokens"] for r in rs)}
        for name, rs in runs.items()}
    rows = [[name, f"{m['compile_ms']:.1f}", f"{m['mask_us_median']:.0f}",
             f"{m['mask_us_mean']:.0f}", f"{m['batch64_ms']:.1f}", m["refused_instance_tokens"]]
            for name, m in medians.items()]
    print(markdown_table(["engine", "compile ms", "mask us (median)", "mask us (mean)",
                          "64 first masks ms", "refused tokens"], rows))
    path = write_results("grammar_engines", {"model": args.model, "vocab_size": vocab_size,
                                             "medians": medians, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
