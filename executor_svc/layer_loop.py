"""The decoder's forward as a plain loop over its fused layers, without transformers' wrappers.

Once fused_layers.py has replaced every norm, attention and MLP of a Llama-family decoder,
a layer is four module calls and two residual adds. transformers' model and layer classes
spend about 1.5 ms a step around them (SmolLM2, 30 layers: keyword plumbing, output records,
a causal mask the paged attention never reads): a bfloat16 decode step of a few sequences
takes 3-9% less time without them (bench/README.md). This loop makes the same calls in the
same order, so the logits are the same bits (tests/executor/test_layer_loop.py); any model
it does not recognise keeps transformers' forward.

A step of decode rows and prompts without a cached prefix (StackPlan) goes through every
layer in one C++ call instead (LayerStack, cpu_kernels/csrc/layer_stack.cpp): the same ops in
the same order, without the ~25 Python-level calls a layer that cost as much as the matmuls
at decode sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import structlog
import torch
from transformers import PreTrainedModel

from executor_svc.attention import STEP_KWARG
from executor_svc.attention.cpu_backend import KernelDecode, KernelFreshPrefill
from executor_svc.attention.torch_backend import TorchStepAttention
from executor_svc.fused_layers import (
    FusedRMSNorm,
    FusedRotaryAttention,
    FusedSiluMLP,
    onednn_weight,
)
from executor_svc.packed_linear import (
    MKL_PACKED_MAX_ROWS,
    MKL_PACKED_MIN_ROWS,
    MklWeight,
    PackedLinear,
)

log = structlog.get_logger(__name__)

# The CausalLM classes whose forward is embed -> layers -> norm -> lm_head on kept rows, and
# whose decoder layers are pre-norm attention then MLP, each with a residual add.
CAUSAL_LMS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


@dataclass(frozen=True)
class LayerStack:
    """Every layer's weights in the order layer_stack.cpp reads them, where every layer's
    linears are packed as that kernel takes them (no bias, no adapters):
    - oneDNN (bfloat16; float32 off Intel CPUs): q/k/v as one matmul and the MLP in the
      epilogues, with their plain weights (a step of a few rows reads those, as OneDnnWeight
      does);
    - MKL (float32 on Intel CPUs): with their weights, for the rows MKL does not serve."""

    kernels: ModuleType
    weights: tuple[torch.Tensor, ...]
    num_heads: int
    eps: float
    scaling: float
    onednn: bool

    @classmethod
    def of(cls, layers: Any, kernels: ModuleType | None) -> LayerStack | None:
        if kernels is None or not hasattr(kernels, "layer_stack"):
            return None
        weights: list[torch.Tensor] = []
        eps, scaling, num_heads = set(), set(), set()
        onednn = layers[0].self_attn.qkv is not None
        for layer in layers:
            tensors = _layer_tensors(layer, onednn, kernels)
            if tensors is None:
                return None
            weights += tensors
            eps |= {layer.input_layernorm.variance_epsilon,
                    layer.post_attention_layernorm.variance_epsilon}
            attention = layer.self_attn
            scaling.add(attention.scaling)
            num_heads.add(attention.q_proj.out_features // attention.head_dim)
        if len(eps) != 1 or len(scaling) != 1 or len(num_heads) != 1:
            return None
        if onednn and not kernels.onednn_linear_ops_available():
            # Checked here, not at the first step it takes, which would fail every step after.
            log.warning("layer_stack_off", reason="this torch's oneDNN linear operators do "
                        "not have the signatures layer_stack calls: the Python loop runs")
            return None
        return cls(kernels, tuple(weights), num_heads.pop(), eps.pop(), scaling.pop(), onednn)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 plan: StackPlan) -> torch.Tensor:
        """hidden [T, H], cos and sin [T, D] -> the last layer's hidden states [T, H]."""
        decode, fresh = plan.decode, plan.fresh
        return self.kernels.layer_stack(
            hidden, cos, sin, self.weights, plan.step.cache.kv, plan.step.slot_mapping.tensor,
            _NO_ROWS if decode is None else decode.token_index,
            _NO_TABLES if decode is None else decode.block_tables,
            _NO_LENS if decode is None else decode.context_lens,
            _NO_ROWS if fresh is None else fresh.starts,
            _NO_ROWS if fresh is None else fresh.lengths,
            self.num_heads, self.eps, self.scaling, self.onednn, MKL_PACKED_MIN_ROWS,
            MKL_PACKED_MAX_ROWS)


# A step's plan without decode rows, or without fresh prompts, passes these (never read).
_NO_ROWS = torch.empty(0, dtype=torch.long)
_NO_TABLES = torch.empty(0, 1, dtype=torch.int32)
_NO_LENS = torch.empty(0, dtype=torch.int32)


@dataclass(frozen=True)
class StackPlan:
    """A step the C++ stack can take whole: decode rows through the paged decode kernel and
    prompts without a cached prefix through the prefill kernel, nothing else."""

    step: TorchStepAttention
    decode: KernelDecode | None
    fresh: KernelFreshPrefill | None

    @classmethod
    def of(cls, step: object) -> StackPlan | None:
        if not isinstance(step, TorchStepAttention) or step.prefill_spans:
            return None
        decode = step.decode
        if decode is not None and not isinstance(decode, KernelDecode):
            return None
        fresh: KernelFreshPrefill | None = None
        if step.fresh_prefills:
            (planned, *others) = step.fresh_prefills
            if others or not isinstance(planned, KernelFreshPrefill):
                return None
            fresh = planned
        if decode is None and fresh is None:
            return None
        return cls(step, decode, fresh)


def _layer_tensors(layer: Any, onednn: bool, kernels: ModuleType) -> list[torch.Tensor] | None:
    """A layer's tensors in layer_stack.cpp's order for its oneDNN or MKL layout, or None
    where it cannot take them."""
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(p.bias is not None for p in projections):
        return None
    dtype = attention.q_proj.weight.dtype
    if onednn:
        o, down = onednn_weight(attention.o_proj), onednn_weight(mlp.down_proj)
        if attention.qkv is None or mlp.epilogues is None or o is None or down is None:
            return None
        if not all(p.weight.is_contiguous() for p in projections):  # a few rows read them
            return None
        gate, up = mlp.epilogues
        packed = (attention.qkv[0], o, gate, up, down)
        if not all(w.reads_plain_through(kernels) for w in packed):  # the stack's few rows do
            return None
        return [norms[0], attention.qkv[0].packed, o.packed, norms[1], gate.packed, up.packed,
                down.packed, *(p.weight for p in projections)]
    pairs: list[torch.Tensor] = []  # each projection's weight, then its MKL-packed copy
    for p in projections:
        if (dtype != torch.float32 or not isinstance(p, PackedLinear)
                or not isinstance(p.packed, MklWeight)
                or (p.min_rows, p.max_rows) != (MKL_PACKED_MIN_ROWS, MKL_PACKED_MAX_ROWS)):
            return None
        pairs += [p.weight, p.packed.packed]
    return [norms[0], *pairs[:8], norms[1], *pairs[8:]]


class LayerLoop:
    def __init__(self, model: PreTrainedModel, kernels: ModuleType | None = None) -> None:
        self.model = model
        self.decoder: Any = model.model
        self.layer_stack = LayerStack.of(self.decoder.layers, kernels)

    @classmethod
    def of(cls, model: PreTrainedModel, kernels: ModuleType | None = None) -> LayerLoop | None:
        """The loop for `model`, or None where one of its layers is not fused_layers' own;
        with the CPU `kernels`, steps run through LayerStack where it applies (StackPlan)."""
        if type(model).__name__ not in CAUSAL_LMS:
            return None
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if decoder is None or not layers:
            return None
        for layer in layers:
            if not (type(layer).__name__ in DECODER_LAYERS
                    and isinstance(layer.input_layernorm, FusedRMSNorm)
                    and isinstance(layer.self_attn, FusedRotaryAttention)
                    and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
                    and isinstance(layer.mlp, FusedSiluMLP)):
                return None
        return cls(model, kernels)

    def __call__(self, attention_step: object, input_ids: torch.Tensor,
                 positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] long; keep [S] long -> the kept rows' logits [S, V]."""
        decoder = self.decoder
        step = {STEP_KWARG: attention_step}
        with torch.inference_mode():
            hidden = decoder.embed_tokens(input_ids[None])  # [1, T, H]
            rotary = decoder.rotary_emb(hidden, positions[None])  # cos, sin [1, T, D]
            plan = None if self.layer_stack is None else StackPlan.of(attention_step)
            if self.layer_stack is not None and plan is not None:
                cos, sin = (r[0].contiguous() for r in rotary)
                hidden = self.layer_stack(hidden[0], cos, sin, plan)[None]
            else:
                for layer in decoder.layers:
                    residual = hidden
                    hidden, _ = layer.self_attn(layer.input_layernorm(hidden), rotary, None,
                                                **step)
                    hidden = residual + hidden
                    residual = hidden
                    hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = decoder.norm(hidden)
            return self.model.lm_head(hidden[:, keep])[0]
