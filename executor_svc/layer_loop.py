"""The decoder's forward as a plain loop over its fused layers, without transformers' wrappers.

Once fused_layers.py has replaced every norm, attention and MLP of a Llama-family decoder,
a layer is four module calls and two residual adds. transformers' model and layer classes
spend about 1.5 ms a step around them (SmolLM2, 30 layers: keyword plumbing, output records,
a causal mask the paged attention never reads): a bfloat16 decode step of a few sequences
takes 3-9% less time without them (bench/README.md). This loop makes the same calls in the
same order, so the logits are the same bits (tests/executor/test_layer_loop.py); any model
it does not recognise keeps transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from executor_svc.attention import STEP_KWARG
from executor_svc.fused_layers import FusedRMSNorm, FusedRotaryAttention, FusedSiluMLP

# The CausalLM classes whose forward is embed -> layers -> norm -> lm_head on kept rows, and
# whose decoder layers are pre-norm attention then MLP, each with a residual add.
CAUSAL_LMS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


class LayerLoop:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.decoder: Any = model.model

    @classmethod
    def of(cls, model: PreTrainedModel) -> LayerLoop | None:
        """The loop for `model`, or None where one of its layers is not fused_layers' own."""
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
        return cls(model)

    def __call__(self, attention_step: object, input_ids: torch.Tensor,
                 positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] long; keep [S] long -> the kept rows' logits [S, V]."""
        decoder = self.decoder
        step = {STEP_KWARG: attention_step}
        with torch.inference_mode():
            hidden = decoder.embed_tokens(input_ids[None])  # [1, T, H]
            rotary = decoder.rotary_emb(hidden, positions[None])  # cos, sin [1, T, D]
            for layer in decoder.layers:
                residual = hidden
                hidden, _ = layer.self_attn(layer.input_layernorm(hidden), rotary, None, **step)
                hidden = residual + hidden
                residual = hidden
                hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = decoder.norm(hidden)
            return self.model.lm_head(hidden[:, keep])[0]
