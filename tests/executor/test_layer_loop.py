"""The fused decoder's own layer loop (layer_loop.py) against transformers' forward of the
same fused modules: the same logits, bit for bit, on prefill, chunked and decode rows."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

from executor_svc.attention.cpu_backend import PREFILL_HEAD_DIMS, prefill_kernel_dtypes
from executor_svc.layer_loop import LayerLoop, LayerStack
from executor_svc.packed_linear import MATMUL_LIBRARY_ENV
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
    runners = {"looped": looped, "plain": plain}
    for feed in feeds:
        logits = _step_logits(runners, drivers, feed)
        assert torch.equal(logits["looped"], logits["plain"])


def _step_logits(runners: dict[str, ModelRunner], drivers: dict[str, Driver],
                 feed: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """One step of the same feed through each runner (its own driver's blocks): the logits."""
    logits = {}
    for name, runner in runners.items():
        seqs = tuple(drivers[name].work(rid, tokens, sample=True) for rid, tokens in feed.items())
        logits[name] = runner.run_forward(StepRequest(seqs=seqs)).logits
    return logits


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


class _Counted:
    """Counts the C++ stack's calls, so that a test knows which path a step took."""

    def __init__(self, stack: LayerStack) -> None:
        self.stack, self.calls = stack, 0

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.stack(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("preset", "dtype", "library"), [
    ("tiny-llama", "bfloat16", "mkl"), ("tiny-mistral", "bfloat16", "mkl"),
    ("tiny-llama-hd128", "bfloat16", "mkl"), ("tiny-llama", "bfloat16", "onednn"),
    ("tiny-llama", "float32", "mkl"), ("tiny-llama-hd128", "float32", "mkl"),
    ("tiny-llama", "float32", "onednn"), ("tiny-llama-hd128", "float32", "onednn"),
])
def test_layer_stack_gives_the_python_loops_bits(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch, preset: str,
    dtype: str, library: str,
) -> None:
    """Steps through the C++ stack against the Python layer loop: the same logits, bit for
    bit, step after step (each step reads the K/V the stack wrote before), at six rows and
    five (oneDNN's or MKL's packed weights) and at four, two and one (under oneDNN, the plain
    weights through small_rows_linear), whichever library computes the linears; prompts
    (alone, or joining decode rows) go through it where the prefill kernel takes them, and a
    chunk after a cached prefix never does."""
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, library)
    stacked = make_runner(preset, dtype=dtype, backend="cpu")
    looped = make_runner(preset, dtype=dtype, backend="cpu")
    loop = stacked.loaded.layer_loop
    assert loop is not None and loop.layer_stack is not None
    assert loop.layer_stack.onednn == (dtype == "bfloat16" or library == "onednn")
    assert loop.layer_stack.kernels.SMALL_ROWS_MAX == 4  # the feeds below straddle it
    counted = _Counted(loop.layer_stack)
    loop.layer_stack = counted  # type: ignore[assignment]
    reference = looped.loaded.layer_loop
    assert reference is not None
    reference.layer_stack = None
    names = [f"r{i}" for i in range(6)]
    prompts = random_prompts(stacked.info.vocab_size, [9, 40, 4, 17, 3, 21, 12, 2, 530],
                             seed=5)
    drivers = {"stacked": Driver.scattered(stacked), "looped": Driver.scattered(looped)}
    feeds = [dict(zip(names, prompts, strict=False))]
    feeds += [{name: [11 + step + i] for i, name in enumerate(names)} for step in range(4)]
    feeds += [{name: [7] for name in names[:5]}, {name: [8] for name in names[:4]}]
    feeds += [{"r1": [3], "r3": [4]}, {"r2": [5]}]  # fewer rows than before
    feeds += [{"r0": [6], "r1": [6], "r6": prompts[6]}]  # a prompt joins two decode rows
    feeds += [{"r0": [2], "r7": prompts[7]}]  # three rows: the few-row linears and a prompt
    feeds += [{"r8": prompts[8]}]  # past MKL's packed rows (512): F.linear there
    feeds += [{"r2": [1, 2, 3], "r3": [9]}]  # a chunk after r2's cached tokens
    prompt_feeds = (0, len(feeds) - 4, len(feeds) - 3, len(feeds) - 2)
    fresh_kernel = (getattr(torch, dtype) in prefill_kernel_dtypes()
                    and stacked.loaded.config.head_dim in PREFILL_HEAD_DIMS)
    runners = {"stacked": stacked, "looped": looped}
    for index, feed in enumerate(feeds):
        before = counted.calls
        logits = _step_logits(runners, drivers, feed)
        assert torch.equal(logits["stacked"], logits["looped"]), f"step {index}"
        stacked_now = (fresh_kernel if index in prompt_feeds else index != len(feeds) - 1)
        assert counted.calls - before == int(stacked_now), f"step {index}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layer_stack_only_where_every_linear_is_packed_for_it(
    make_runner: Callable[..., ModelRunner], matmul_library: str, dtype: str
) -> None:
    # q/k/v with a bias (Qwen2): its decode steps keep the Python loop.
    qwen2 = make_runner("tiny-qwen2", dtype=dtype, backend="cpu").loaded.layer_loop
    assert qwen2 is not None and qwen2.layer_stack is None
    # LoRA wraps the projections for its adapters: every step keeps the Python loop.
    lora = make_runner("tiny-llama", dtype=dtype, backend="cpu", enable_lora=True)
    assert lora.loaded.layer_loop is None or lora.loaded.layer_loop.layer_stack is None
    llama = make_runner("tiny-llama", dtype=dtype, backend="cpu").loaded.layer_loop
    assert llama is not None and llama.layer_stack is not None
    layers, kernels = llama.model.model.layers, llama.layer_stack.kernels
    if llama.layer_stack.onednn:
        # A fused q/k/v whose few rows would take oneDNN in the Python loop: the stack would
        # read the plain weights and the bits would part.
        qkv, bias = layers[1].self_attn.qkv
        layers[1].self_attn.qkv = (dataclasses.replace(qkv, kernels=None), bias)
        assert LayerStack.of(layers, kernels) is None
        layers[1].self_attn.qkv = (qkv, bias)
        assert LayerStack.of(layers, kernels) is not None
    down = layers[0].mlp.down_proj
    layers[0].mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    assert LayerStack.of(layers, kernels) is None


class _OtherOneDnn:
    """The CPU kernels as on a torch whose oneDNN linear signatures differ from layer_stack's
    (the lookup that reports it runs for real: test_layer_stack_finds_its_onednn_ops)."""

    def __init__(self, kernels: object) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernels, name)

    def onednn_linear_ops_available(self) -> bool:
        return False


def test_layer_stack_finds_its_onednn_ops_or_keeps_the_python_loop(
        make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    # This torch's operators match (looked up for real); a torch whose do not keeps the
    # Python loop from the start wherever the layers are oneDNN-packed (bfloat16; float32
    # off Intel CPUs), and float32 with MKL's layout never calls them.
    bf16 = make_runner("tiny-llama", dtype="bfloat16", backend="cpu").loaded.layer_loop
    assert bf16 is not None and bf16.layer_stack is not None
    kernels = bf16.layer_stack.kernels
    assert kernels.onednn_linear_ops_available()
    assert LayerStack.of(bf16.decoder.layers, _OtherOneDnn(kernels)) is None  # type: ignore[arg-type]
    for library, stacks in (("mkl", True), ("onednn", False)):
        monkeypatch.setenv(MATMUL_LIBRARY_ENV, library)
        fp32 = make_runner("tiny-llama", dtype="float32", backend="cpu").loaded.layer_loop
        assert fp32 is not None
        stack = LayerStack.of(fp32.decoder.layers, _OtherOneDnn(kernels))  # type: ignore[arg-type]
        assert (stack is not None) == stacks


def _stack_inputs(runner: ModelRunner, tokens: int = 2) -> dict[str, object]:
    loop = runner.loaded.layer_loop
    assert loop is not None and loop.layer_stack is not None
    stack = loop.layer_stack
    hidden_size, head_dim = runner.loaded.config.hidden_size, runner.loaded.config.head_dim
    kv = runner.cache.kv
    return {
        "hidden": torch.randn(tokens, hidden_size).bfloat16(),
        "cos": torch.ones(tokens, head_dim).bfloat16(),
        "sin": torch.zeros(tokens, head_dim).bfloat16(),
        "weights": list(stack.weights), "kv": kv,
        "slots": torch.arange(tokens, dtype=torch.long),
        "rows": torch.arange(tokens, dtype=torch.long),
        "tables": torch.zeros(tokens, 1, dtype=torch.int32),
        "lens": torch.ones(tokens, dtype=torch.int32),
        "fresh_starts": torch.empty(0, dtype=torch.long),
        "fresh_lengths": torch.empty(0, dtype=torch.long),
        "num_heads": stack.num_heads, "eps": stack.eps, "scale": stack.scaling,
        "onednn": stack.onednn,
        "mkl_min_rows": 2, "mkl_max_rows": 512,
    }


@pytest.mark.parametrize(("change", "message"), [
    ({"slots": torch.tensor([0, -1])}, "a slot is outside the cache"),
    ({"slots": torch.tensor([0, 10**9])}, "a slot is outside the cache"),
    ({"slots": torch.tensor([0])}, "slots must be [T] int64"),
    ("drop_weight", "takes 14 weights for each of the cache's"),
    ("double_hidden", "hidden must be bfloat16 (oneDNN-packed layers) or float32"),
    ({"onednn": False}, "hidden must be bfloat16 (oneDNN-packed layers) or float32"),
    ("float_hidden", "the cache must be [L, 2, NB, S, Hkv, D], contiguous, of hidden's dtype"),
    ("float_cache", "the cache must be [L, 2, NB, S, Hkv, D], contiguous, of hidden's dtype"),
    # (Refused inside layer 0's attention, after its K/V were written, as the Python path.)
    ({"lens": torch.tensor([1, 0], dtype=torch.int32)}, "a context length is outside 1.."),
    ({"num_heads": 1}, "the q/k/v weight's width is not"),
])
def test_layer_stack_refuses_bad_inputs(
    make_runner: Callable[..., ModelRunner], change: object, message: str
) -> None:
    runner = make_runner("tiny-llama", dtype="bfloat16", backend="cpu")
    inputs = _stack_inputs(runner)
    if change == "drop_weight":
        inputs["weights"] = inputs["weights"][:-1]  # type: ignore[index]
    elif change == "double_hidden":
        inputs["hidden"] = inputs["hidden"].double()  # type: ignore[attr-defined]
    elif change == "float_hidden":
        inputs["hidden"] = inputs["hidden"].float()  # type: ignore[attr-defined]
    elif change == "float_cache":
        inputs["kv"] = inputs["kv"].float()  # type: ignore[attr-defined]
    else:
        inputs.update(change)  # type: ignore[call-overload]
    kernels = runner.loaded.layer_loop.layer_stack.kernels  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.layer_stack(*inputs.values())


@pytest.mark.parametrize(("change", "message"), [
    ({"fresh_starts": torch.tensor([1]), "fresh_lengths": torch.tensor([5])},
     "a prompt's rows are outside q"),
    ({"fresh_starts": torch.tensor([0, 1]), "fresh_lengths": torch.tensor([1])},
     "starts and lengths must be [P] int64"),
    ({"fresh_starts": torch.tensor([0], dtype=torch.int32), "fresh_lengths": torch.tensor([2])},
     "starts and lengths must be [P] int64"),
])
def test_layer_stack_refuses_bad_prompt_rows(
    make_runner: Callable[..., ModelRunner], change: dict[str, torch.Tensor], message: str
) -> None:
    # A step of two fresh prompt rows (no decode rows), its prompts' rows described wrongly.
    runner = make_runner("tiny-llama-hd128", dtype="bfloat16", backend="cpu")
    inputs = _stack_inputs(runner)
    inputs.update({"rows": torch.empty(0, dtype=torch.long),
                   "tables": torch.empty(0, 1, dtype=torch.int32),
                   "lens": torch.empty(0, dtype=torch.int32), **change})
    kernels = runner.loaded.layer_loop.layer_stack.kernels  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.layer_stack(*inputs.values())
