"""Linear layers on CPU on a weight laid out ("packed") once at load for the matmul library.

torch's CPU `F.linear` re-lays its weight out for the matmul library on every call (in a
profile of a float32 decode step, MKL's weight copy `sgemm_scopy` took 12% of the executor's
time). A weight packed once skips that:
- bfloat16, and float32 off Intel CPUs: oneDNN's `_linear_pointwise` on a weight reordered
  once (`_reorder_linear_weight`, the ops inductor's freezing pass uses) for every row count;
  its epilogue can also apply SiLU, or multiply by another tensor, as the product is written
  (fused_layers.py's MLP);
- float32 on Intel CPUs: MKL's packed GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`,
  through the CPU kernels: cpu_kernels/csrc/packed_gemm.cpp) for 2 to MKL_PACKED_MAX_ROWS
  rows.
A oneDNN-packed layer of 1 to SMALL_ROWS_MAX rows (a decode step of a few sequences) reads its
plain weight through the CPU kernels' small_rows_linear instead (OneDnnWeight).

MKL takes its fast code paths on Intel CPUs only. On an AMD EPYC with AVX-512 its sgemm, packed
or not, ran SmolLM2's layers 1.7-2.7x slower than oneDNN (1 to 2,048 rows) and its head 2-5x
slower (`python -m bench.matmul_libraries`; bench/README.md, "MKL or oneDNN, by CPU"), so
there every float32 linear layer goes through oneDNN (`matmul_library()`).

Measured on an Intel Xeon (two threads, SmolLM2-135M's seven shapes in each of 30 layers
cycled, so that weights come from DRAM as in the model; ms for all 210, F.linear / packed):

    rows          1      4      16     64     256     512    1,024   2,048
    F.linear    16.4   26.7    37.4   58.6   177    285     545    1,123
    MKL packed  17.5   22.2    30.1   49.3   160    282     554    1,182

There a float32 decode step takes 13-15% less time at 4-64 sequences, with the same tokens
(`python -m bench.fused_layers --baseline unpacked`); prefill chunks (more rows) keep
F.linear. oneDNN's packing, tried first for float32, gained nothing on a whole step there; in
bfloat16 it ran a decode step 14-23% faster (1, 16 and 64 sequences) with the same tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from common.cpu_info import cpu_vendor

log = structlog.get_logger(__name__)

ONEDNN_PACK_FOR_ROWS = 64  # the row count oneDNN lays the weight out for (16..256 the same)
MKL_PACKED_MIN_ROWS = 2  # one row: F.linear was as fast (above), and batch-1 stays bit-equal
MKL_PACKED_MAX_ROWS = 512  # float32: more rows (prefill chunks) take F.linear
# "mkl" or "onednn" instead of the CPU's own choice (matmul_library): tests and A/Bs.
MATMUL_LIBRARY_ENV = "PAGEDKV_MATMUL_LIBRARY"
MATMUL_LIBRARIES = ("mkl", "onednn")
# The packed product's agreement with F.linear, checked once per weight at load.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PackedWeight(Protocol):
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> x @ weight^T + bias [..., out]."""


@dataclass(frozen=True)
class OneDnnWeight:
    """oneDNN's packed copy of a weight; with the CPU kernels and the plain weights it was
    packed from (side by side), inputs of 1 to SMALL_ROWS_MAX rows read those instead
    (small_rows_linear): oneDNN spends ~20 us a call besides the bytes, most of a small
    layer's time at a decode step of a few sequences (bench/README.md, "A few rows on the
    plain weights")."""

    packed: torch.Tensor  # oneDNN's layout
    plain: tuple[torch.Tensor, ...] = ()  # [out_i, in] each, contiguous
    kernels: ModuleType | None = None

    def _few_rows(self, x: torch.Tensor) -> bool:
        return (self.kernels is not None and bool(self.plain)
                and 0 < x.numel() <= self.kernels.SMALL_ROWS_MAX * x.shape[-1])

    def reads_plain_through(self, kernels: ModuleType) -> bool:
        """Whether a few rows take `kernels`' small_rows_linear (as the C++ stack's do)."""
        return self.kernels is kernels and bool(self.plain)

    def _small(self, x: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
               other: torch.Tensor | None = None) -> torch.Tensor:
        """`epilogue`: NONE, SILU or TIMES, the kernels' own values (SmallRowsEpilogue)."""
        assert self.kernels is not None
        rows = x.reshape(-1, x.shape[-1])
        if other is not None:
            other = other.reshape(rows.shape[0], -1).contiguous()
        out = self.kernels.small_rows_linear(rows, list(self.plain), bias,
                                             getattr(self.kernels, f"EPILOGUE_{epilogue}"), other)
        return out.view(*x.shape[:-1], out.shape[-1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._few_rows(x):
            return self._small(x, bias, "NONE")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def linear_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ weight^T), the SiLU applied in float32 before the product is rounded."""
        if self._few_rows(x):
            return self._small(x, None, "SILU")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "swish", [], "")

    def linear_times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ weight^T) * other, multiplied in float32 before the product is rounded."""
        if self._few_rows(x):
            return self._small(x, None, "TIMES", other)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, None, "mul")


@dataclass(frozen=True)
class MklWeight:
    packed: torch.Tensor  # MKL's layout, bytes; never copied (it must stay at its address)
    out_features: int
    kernels: ModuleType

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.kernels.mkl_packed_linear(rows, self.packed, self.out_features)
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinear(torch.nn.Module):
    """Replaces an nn.Linear; same parameters (state_dict unchanged) plus a packed copy used
    for inputs of `min_rows` to `max_rows` rows (None: no limit). `packed` becomes None when a
    fused copy replaces it (pack_concatenated): F.linear then serves every call.

    The packed copy is made once: loading other weights into this module would leave it stale
    (the executor never does; tests load the executor's weights into other models).
    """

    def __init__(
        self, linear: torch.nn.Linear, packed: PackedWeight, min_rows: int,
        max_rows: int | None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # [out, in] (a view of another layout, maybe)
        self.bias = linear.bias
        self.packed: PackedWeight | None = packed  # a plain attribute: never saved or loaded
        self.min_rows = min_rows
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if (
            self.packed is None
            or rows < self.min_rows
            or (self.max_rows is not None and rows > self.max_rows)
        ):
            return F.linear(x, self.weight, self.bias)
        return self.packed.linear(x, self.bias)

    def onednn_weight(self) -> OneDnnWeight | None:
        """Its oneDNN-packed weight when that serves every row count."""
        if isinstance(self.packed, OneDnnWeight) and self.min_rows <= 1 and self.max_rows is None:
            return self.packed
        return None


def pack_concatenated(
    linears: list[torch.nn.Module],
) -> tuple[OneDnnWeight, torch.Tensor | None] | None:
    """One oneDNN-packed weight (and bias) for layers that read the same input, their outputs
    side by side, where each is packed for oneDNN: one matmul instead of several (a call costs
    ~20 us besides its bytes); a few rows read their plain weights side by side where theirs
    did. Their own packed copies are dropped (they keep F.linear)."""
    layers = [m for m in linears if isinstance(m, PackedLinear) and m.onednn_weight() is not None]
    biases = [m.bias for m in layers]
    if len(layers) != len(linears) or len({b is None for b in biases}) > 1:
        return None
    kernels = {own.kernels for m in layers if (own := m.onednn_weight()) is not None}
    weights = tuple(m.weight.detach() for m in layers)
    packed = pack_weight(torch.cat(weights), kernels.pop() if len(kernels) == 1 else None,
                         weights)
    if packed is None:
        return None
    for m in layers:
        m.packed = None
    if biases[0] is None:
        return packed, None
    return packed, torch.cat([b.detach() for b in biases if b is not None])


def _agrees(packed: PackedWeight, weight: torch.Tensor) -> bool:
    """The packed product against F.linear's at 2 rows and 8 (a few rows may take the plain
    weight, more the packed one)."""
    tolerance = _TOLERANCE.get(weight.dtype, 1e-4)
    for rows in (2, 8):
        probe = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        got, expected = packed.linear(probe, None), F.linear(probe, weight)
        if not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
            log.warning("linear_not_packed", reason="packed product disagrees with F.linear")
            return False
    return True


def matmul_library() -> str:
    """Who computes the linear layers where MKL and oneDNN both could: "mkl" on Intel CPUs
    (float32 of 2 to 512 rows), "onednn" elsewhere, where
    MKL runs its slow generic code; PAGEDKV_MATMUL_LIBRARY overrides."""
    chosen = os.environ.get(MATMUL_LIBRARY_ENV, "").strip().lower()
    if chosen:
        if chosen not in MATMUL_LIBRARIES:
            raise ValueError(f"{MATMUL_LIBRARY_ENV}={chosen!r}: choose one of "
                             f"{', '.join(MATMUL_LIBRARIES)} (or unset it: the CPU decides)")
        return chosen
    return "mkl" if cpu_vendor() == "GenuineIntel" else "onednn"


def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    not on AVX2-only machines), as oneDNN itself says (it honours ONEDNN_MAX_CPU_ISA)."""
    return (torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def pack_weight(
    weight: torch.Tensor, kernels: ModuleType | None = None,
    plain: tuple[torch.Tensor, ...] | None = None,
) -> OneDnnWeight | None:
    """oneDNN's packed copy of a [out, in] weight, or None where torch cannot make one; with
    the CPU `kernels`, a few rows read the plain weight (or `plain`, the parts `weight` was
    concatenated from) through them instead."""
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not onednn_packs_bfloat16():
        log.info("linears_not_packed", reason="this CPU has no oneDNN bfloat16 kernels "
                 "(AVX-512 BW/VL/DQ or AVX-NE-CONVERT); bfloat16 linear layers keep F.linear")
        return None
    parts = tuple(p.contiguous() for p in (plain or (weight.detach(),))) if kernels else ()
    try:
        packed = OneDnnWeight(
            torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_FOR_ROWS), parts, kernels)
        return packed if _agrees(packed, weight) else None
    except (AttributeError, RuntimeError) as exc:  # an op missing from this torch build
        log.warning("linear_not_packed", reason=str(exc)[:200])
        return None


def mkl_pack_weight(weight: torch.Tensor, kernels: ModuleType) -> MklWeight | None:
    """MKL's packed copy of a float32 [out, in] weight, or None where torch's build lacks it."""
    if not kernels.mkl_packed_gemm_available():
        return None
    packed = MklWeight(kernels.mkl_pack_weight(weight.detach()), weight.shape[0], kernels)
    return packed if _agrees(packed, weight) else None


def pack_linears(model: PreTrainedModel, kernels: ModuleType | None) -> int:
    """On CPU, every nn.Linear becomes a PackedLinear: bfloat16 through oneDNN at every row
    count; float32, when the CPU kernels are built (`kernels`), through MKL for decode-sized
    inputs on Intel CPUs and through oneDNN at every row count elsewhere (matmul_library).
    Returns how many were packed (0 otherwise, logged when MKL is missing)."""
    library = matmul_library()
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue  # the lm_head is a PackedLinear already (lm_head.py)
            float32 = child.weight.dtype == torch.float32
            if child.weight.dtype == torch.bfloat16 or (float32 and kernels is not None
                                                        and library == "onednn"):
                packed: PackedWeight | None = pack_weight(child.weight, kernels)
                rows: tuple[int, int | None] = (1, None)
            elif float32 and kernels is not None:
                packed = mkl_pack_weight(child.weight, kernels)
                rows = (MKL_PACKED_MIN_ROWS, MKL_PACKED_MAX_ROWS)
                if packed is None and replaced == 0:
                    log.info("linears_not_packed", reason="torch's build has no MKL "
                             "packed GEMM; float32 linear layers keep F.linear")
            else:
                continue
            if packed is None:
                return replaced
            setattr(module, name, PackedLinear(child, packed, *rows))
            replaced += 1
    return replaced
