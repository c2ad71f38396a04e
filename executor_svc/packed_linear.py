"""Linear layers on CPU through oneDNN, on a weight laid out ("packed") once at load.

torch's CPU `F.linear` re-lays its weight out for the matmul library on every call. oneDNN's
`_linear_pointwise` on a weight reordered once (`_reorder_linear_weight`, the ops inductor's
freezing pass uses) skips that. Whether it pays depends on the dtype and on the rows, measured
on this project's CPU (two threads, SmolLM2-135M's shapes, us a call, F.linear / packed):

    rows     float32 576->1536    bfloat16 576->1536    bfloat16 576->576
    1          36 / 28 (cached)       67 / 28               42 / 22
    16        170 / 109              73 / 31               40 / 22
    64        404 / 352             114 / 67               56 / 35
    512      2458 / 2357            377 / 333             148 / 225

In the model, weights come from DRAM: in float32 packing gained nothing on a whole step
(decode and prefill within 1%, so only the lm_head is packed: lm_head.py), in bfloat16 a decode
step ran 14-23% faster (1, 16 and 64 sequences) with the same tokens. Above PACKED_MAX_ROWS
(prefill) F.linear is kept: packed, some shapes were slower there.
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

log = structlog.get_logger(__name__)

PACK_FOR_ROWS = 64  # the row count oneDNN lays the weight out for (16..256 measure the same)
PACKED_MAX_ROWS = 128  # bfloat16: more rows than this (prefill) take F.linear
# The packed product's agreement with F.linear, checked once per weight at load.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PackedLinear(torch.nn.Module):
    """Replaces an nn.Linear; same parameters (state_dict unchanged) plus a packed copy used
    for inputs of `min_rows` to `max_rows` rows (None: no limit).

    The packed copy is made once: loading other weights into this module would leave it stale
    (the executor never does; tests load the executor's weights into other models).
    """

    def __init__(
        self, linear: torch.nn.Linear, packed: torch.Tensor, min_rows: int,
        max_rows: int | None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # [out, in] (a view of another layout, maybe)
        self.bias = linear.bias
        self.packed = packed  # oneDNN layout; a plain attribute: never saved or loaded
        self.min_rows = min_rows
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows < self.min_rows or (self.max_rows is not None and rows > self.max_rows):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where torch cannot make one."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        probe = torch.randn(4, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:  # an op missing from this torch build
        log.warning("linear_not_packed", reason=str(exc)[:200])
        return None
    tolerance = _TOLERANCE.get(weight.dtype, 1e-4)
    expected = F.linear(probe, weight)
    if not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
        log.warning("linear_not_packed", reason="packed product disagrees with F.linear")
        return None
    return packed


def pack_linears(model: PreTrainedModel) -> int:
    """bfloat16 on CPU: every nn.Linear becomes a PackedLinear for decode-sized inputs.
    Returns how many were packed (0 for other dtypes)."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.dtype != torch.bfloat16:
                continue
            packed = pack_weight(child.weight)
            if packed is None:
                return replaced
            setattr(module, name, PackedLinear(child, packed, 1, PACKED_MAX_ROWS))
            replaced += 1
    return replaced
