"""The output projection (lm_head) on CPU: the largest matmul of a decode step, made cheaper.

Torch's fp32 linear on CPU calls MKL's sgemm on a [vocab, hidden] weight, re-laying it out on
every call. Measured on the small preset (32,000 x 256, one thread), per decode step:

    rows    nn.Linear   [hidden, vocab] storage   oneDNN, weight packed at load
    1         4.7 ms      1.9 ms                    3.0 ms
    16       12.3 ms      8.9 ms                    4.7 ms
    64       24.6 ms     22.5 ms                   12.6 ms

So the weight is stored [hidden, vocab] (same values, read through a transpose) and also
packed once for oneDNN, through the ops torch itself uses for CPU inference
(`torch.ops.mkldnn`, inductor's freezing pass); a step with fewer than PACKED_MIN_ROWS rows
uses the stored weight. Logits agree with nn.Linear within float rounding (about 1e-6).

Tied embeddings (SmolLM2) keep theirs for the embedding lookup, which reads rows, and the head
gets its own copy, stored and packed as above: 113 MB more for SmolLM2-135M, and a decode step
of 8 sequences 64 -> 55 ms on two threads (lm_head 13.1 -> 5.6 ms: the packed layout streams
the 49,152 x 576 weight at memory speed where sgemm on the transposed view did not).
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

log = structlog.get_logger(__name__)

PACKED_MIN_ROWS = 4  # below this, sgemm on the [hidden, vocab] weight is faster
PACK_FOR_ROWS = 64  # the row count oneDNN lays the weight out for (16..256 measure the same)


class PackedLinear(torch.nn.Module):
    """Replaces an nn.Linear; same parameters (state_dict unchanged) plus a packed copy.

    The packed copy is made once: loading other weights into this module would leave it stale
    (the executor never does; tests load the executor's weights into other models).
    """

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # [out, in], stored [in, out]
        self.bias = linear.bias
        self.packed = packed  # oneDNN layout; a plain attribute: never saved or loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.numel() < PACKED_MIN_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where torch cannot make one."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        probe = torch.randn(PACKED_MIN_ROWS, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:  # an op missing from this torch build
        log.warning("lm_head_not_packed", reason=str(exc)[:200])
        return None
    if not torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4):
        log.warning("lm_head_not_packed", reason="packed product disagrees with F.linear")
        return None
    return packed


def speed_up_lm_head(model: PreTrainedModel) -> None:
    """CPU, float32: store the lm_head weight [hidden, vocab] and route it through oneDNN."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return
    embed = model.get_input_embeddings()
    stored = head.weight.detach().t().contiguous()  # [hidden, vocab]; a copy when tied
    if isinstance(embed, torch.nn.Embedding) and embed.weight.data_ptr() == head.weight.data_ptr():
        # A head of its own; the embedding keeps the shared Parameter. (transformers ties
        # weights while loading only, so nothing ties them back.)
        head = torch.nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    head.weight = torch.nn.Parameter(stored.t(), requires_grad=False)  # [vocab, hidden] view
    packed = _pack(head.weight)
    if packed is not None:
        model.set_output_embeddings(PackedLinear(head, packed))
