"""Attention backends behind one interface, plugged into transformers by name.

The model is loaded with `attn_implementation=ATTENTION_NAME`; transformers then calls
`paged_attention_forward` in every attention layer (after RoPE) with query `[1, Hq, T, D]` and
key/value `[1, Hkv, T, D]` for the step's packed row. The step's plan travels as an extra
keyword argument of `model(...)` (STEP_KWARG), never as module state: a backend's `plan()` runs
once per step, before the forward (it adds its device arrays to the step's StepArrays, which
the runner then sends in one copy), and the returned StepAttention's `forward()` once per layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import AttentionInterface

from executor_svc.attention.metadata import AttentionShape, SeqSpan, StepMetadata
from executor_svc.attention.step_arrays import StepArrays
from executor_svc.kv_cache import KVCache

ATTENTION_NAME = "pagedkv"
STEP_KWARG = "paged_attention"

__all__ = [
    "ATTENTION_NAME",
    "STEP_KWARG",
    "AttentionBackend",
    "AttentionShape",
    "SeqSpan",
    "StepAttention",
    "StepArrays",
    "StepMetadata",
    "make_backend",
    "plan_step",
    "register_attention",
]


class StepAttention(Protocol):
    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [1, Hq, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,  # [1, Hkv, T, D]
        scaling: float,
    ) -> torch.Tensor:  # [1, T, Hq, D]
        """Write this step's K/V into their slots, then attend over each sequence's blocks."""
        ...


class AttentionBackend(Protocol):
    name: str

    def plan(
        self, metadata: StepMetadata, cache: KVCache, shape: AttentionShape
    ) -> StepAttention:
        """Prepare everything the layers share (once per step, outside the forward)."""
        ...


def plan_step(
    backend: AttentionBackend,
    spans: tuple[SeqSpan, ...],
    block_size: int,
    cache: KVCache,
    shape: AttentionShape,
) -> StepAttention:
    """A step planned and its arrays sent, for callers with no arrays of their own (profiling,
    benchmarks, tests)."""
    metadata = StepMetadata.build(spans, block_size, StepArrays(cache.device))
    step = backend.plan(metadata, cache, shape)
    metadata.arrays.send()
    return step


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    step: StepAttention | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention needs `{STEP_KWARG}=` in model(...): "
            "only the executor's runner can call a model loaded with it"
        )
    assert query.shape[0] == 1, f"the step is one packed row, got batch {query.shape[0]}"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer_idx = module.layer_idx
    assert isinstance(layer_idx, int), f"{type(module).__name__} has no integer layer_idx"
    return step.forward(layer_idx, query, key, value, float(scale)), None


def register_attention() -> None:
    """Idempotent: transformers' registry maps the name to our function."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: the C++ kernel backend on CPU where it builds (else torch), torch on CUDA."""
    if name in ("auto", "cpu") and device.type == "cpu":
        from executor_svc.attention.cpu_backend import CpuBackend
        from executor_svc.cpu_kernels import load

        kernel = load()
        if kernel is not None:
            return CpuBackend(kernel)
        if name == "cpu":
            from executor_svc.settings import SettingsError

            raise SettingsError(
                "--backend cpu: the C++ kernels could not be built (see the warning above); "
                "use --backend torch, or install a compiler and run `make setup`"
            )
    if name in ("auto", "torch"):
        from executor_svc.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "flashinfer":
        from executor_svc.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; use auto, cpu, torch or flashinfer")
