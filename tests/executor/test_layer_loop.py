"""The fused decoder's own layer loop (layer_loop.py) against transformers' forward of the
same fused modules: the same logits, bit for bit, on prefill, chunked and decode rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from executor_svc.layer_loop import LayerLoop
from executor_svc.runner import ModelRunner
from executor_svc.step import StepRequest

from .oracle import Driver, random_prompts, reference_model


@pytest.mark.parametrize(("preset", "dtype"), [
    ("tiny-llama", "float32"), ("tiny-qwen2", "float32"), ("tiny-mistral", "float32"),
    ("tiny-llama", "bfloat16"),
])
def test_layer_loop_gives_transformers_forward_bits(
    make_runner: Callable[..., ModelRunner], preset: str, dtype: str
) -> None:
    looped = make_runner(preset, dtype=dtype, backend="cpu")
    plain = make_runner(preset, dtype=dtype, backend="cpu")
    assert looped.loaded.layer_loop is not None
    # transformers' forward over the same fused modules:
    plain.loaded = dataclasses.replace(plain.loaded, layer_loop=None)
    prompts = random_prompts(looped.info.vocab_size, [9, 21, 4], seed=3)
    drivers = {"looped": Driver.scattered(looped), "plain": Driver.scattered(plain)}
    # A whole prompt and the first 10 tokens of another; the rest of it (a chunk after a
    # cached prefix), a decode row and a new prompt; then three decode rows.
    feeds = [
        {"r0": prompts[0], "r1": prompts[1][:10]},
        {"r0": [7], "r1": prompts[1][10:], "r2": prompts[2]},
        {"r0": [8], "r1": [9], "r2": [10]},
    ]
    for feed in feeds:
        logits = {}
        for name, runner in (("looped", looped), ("plain", plain)):
            seqs = tuple(drivers[name].work(rid, tokens, sample=True)
                         for rid, tokens in feed.items())
            logits[name] = runner.run_forward(StepRequest(seqs=seqs)).logits
        assert torch.equal(logits["looped"], logits["plain"])


def test_layer_loop_only_for_fused_decoders(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner("tiny-llama")
    assert LayerLoop.of(reference_model(runner)) is None  # transformers' own modules
    model = runner.loaded.model
    assert LayerLoop.of(model) is not None
    fused_mlp = model.model.layers[1].mlp
    model.model.layers[1].mlp = torch.nn.Identity()  # one layer that is not fused_layers'
    try:
        assert LayerLoop.of(model) is None
    finally:
        model.model.layers[1].mlp = fused_mlp
