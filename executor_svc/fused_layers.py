"""Llama-family layers with their elementwise work in one C++ pass each (CPU).

transformers' LlamaRMSNorm runs five ops a call (cast, pow, mean, rsqrt, two multiplies),
LlamaMLP two for silu(gate) * up and apply_rotary_pos_emb ten for q and k, each a full pass
over its rows and, at decode sizes, tens of microseconds of dispatch: 60 norms, 30 MLPs and
30 rotations a step for SmolLM2. The attention module here also calls the executor's paged
attention directly (the model is loaded with it) instead of through transformers' registry.

The kernels (cpu_kernels/csrc/fused_ops.cpp) compute transformers' formulas, the norm's
statistics in float32 as transformers does; results differ by float rounding only (sums run
in another order), which the parity tests against transformers' own generate cover.

Only the classes listed here are replaced, and only their modules: parameters and their names
stay (the state_dict is unchanged), the linear layers inside an MLP are the same objects.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedModel

from executor_svc.attention import ATTENTION_NAME, paged_attention_forward
from executor_svc.packed_linear import OneDnnWeight, PackedLinear, pack_concatenated

# transformers' classes whose forward is exactly LlamaRMSNorm's / LlamaMLP's.
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP"})
ATTENTION_CLASSES = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what fused_ops.cpp computes in


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, norm: Any, kernel: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.kernel = kernel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H]
        rows = hidden.reshape(-1, hidden.shape[-1])
        return self.kernel.rms_norm(rows, self.weight, self.variance_epsilon).view(hidden.shape)


class FusedSiluMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) with its elementwise work fused: into the gate and up
    matmuls' epilogues where both are oneDNN-packed without bias (bfloat16 on CPU), else into
    one pass (float32 and bfloat16); other dtypes run torch's ops."""

    def __init__(self, mlp: Any, kernel: ModuleType) -> None:
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.kernel = kernel
        gate, up = onednn_weight(mlp.gate_proj), onednn_weight(mlp.up_proj)
        # NOTE: the epilogues round twice (silu(gate), then the product) where transformers
        # rounds four times (gate, up, silu, product): within bf16's tolerance of its output.
        self.epilogues = (gate, up) if gate is not None and up is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.epilogues is not None:
            gate, up = self.epilogues
            return self.down_proj(up.linear_times(x, gate.linear_silu(x)))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype not in KERNEL_DTYPES:
            return self.down_proj(self.act_fn(gate) * up)
        width = gate.shape[-1]
        product = self.kernel.silu_mul(gate.reshape(-1, width), up.reshape(-1, width))
        return self.down_proj(product.view(gate.shape))


def onednn_weight(linear: Any) -> OneDnnWeight | None:
    """A linear layer's oneDNN-packed weight when it has one for every row count and no bias."""
    if isinstance(linear, PackedLinear) and linear.bias is None:
        return linear.onednn_weight()
    return None


class FusedRotaryAttention(torch.nn.Module):
    """q, k, v projections -> rotary in place (one kernel call for q and k) -> the executor's
    paged attention -> o projection. float32 or bfloat16, full-width rotary only (fuse_layers
    checks). Where the three projections are oneDNN-packed (bfloat16 on CPU) they run as one
    matmul on their weights side by side, q, k and v being views of its output."""

    def __init__(self, attention: Any, kernel: ModuleType) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.q_proj = attention.q_proj
        self.k_proj = attention.k_proj
        self.v_proj = attention.v_proj
        self.o_proj = attention.o_proj
        self.kernel = kernel
        self.qkv = pack_concatenated([self.q_proj, self.k_proj, self.v_proj])
        widths = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        self.qkv_widths = widths

    def forward(
        self,
        hidden_states: torch.Tensor,  # [1, T, hidden]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [1, T, D]
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if self.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                "a fused attention runs the executor's paged attention only; load the model "
                "with load_model(..., fused_layers=False) to switch its attention implementation"
            )
        batch, tokens, _ = hidden_states.shape
        heads = (batch, tokens, -1, self.head_dim)
        if self.qkv is not None:
            weight, bias = self.qkv
            projected = weight.linear(hidden_states, bias).split(self.qkv_widths, dim=-1)
            query, key, value = (p.unflatten(-1, (-1, self.head_dim)) for p in projected)
        else:
            query = self.q_proj(hidden_states).view(heads)  # [1, T, Hq, D]
            key = self.k_proj(hidden_states).view(heads)
            value = self.v_proj(hidden_states).view(heads)
        cos, sin = position_embeddings
        self.kernel.rotary_(
            query.flatten(0, 1),  # [T, Hq, D], tokens maybe strided
            key.flatten(0, 1),
            cos.reshape(batch * tokens, self.head_dim),
            sin.reshape(batch * tokens, self.head_dim),
        )
        out, _ = paged_attention_forward(
            self,
            query.transpose(1, 2),  # [1, Hq, T, D]
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask,
            scaling=self.scaling,
            **kwargs,
        )  # [1, T, Hq, D]
        return self.o_proj(out.reshape(batch, tokens, -1)), None


def _full_width_rotary(attention: Any) -> bool:
    config = attention.config
    return (
        getattr(config, "partial_rotary_factor", 1.0) == 1.0
        and attention.head_dim % 2 == 0
        and config._attn_implementation == ATTENTION_NAME
    )


def _is_silu(module: object) -> bool:
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"


def fuse_layers(model: PreTrainedModel, kernel: ModuleType) -> int:
    """Replace the listed norms, SiLU MLPs and attentions in place; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        children: list[tuple[str, Any]] = list(parent.named_children())
        for name, child in children:
            kind = type(child).__name__
            if kind in RMS_NORM_CLASSES and child.weight.dtype in KERNEL_DTYPES:
                setattr(parent, name, FusedRMSNorm(child, kernel))
            elif kind in MLP_CLASSES and _is_silu(child.act_fn):
                setattr(parent, name, FusedSiluMLP(child, kernel))
            elif (
                kind in ATTENTION_CLASSES
                and child.q_proj.weight.dtype in KERNEL_DTYPES
                and _full_width_rotary(child)
            ):
                setattr(parent, name, FusedRotaryAttention(child, kernel))
            else:
                continue
            replaced += 1
    return replaced
