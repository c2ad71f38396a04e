"""small_rows_linear (cpu_kernels/csrc/small_gemm.cpp), the few-row linear layers on the
plain weights, against float64 products; and OneDnnWeight's choice between it and oneDNN.
Whole-model parity through it (the layer stack's bits against the Python loop at 1 to 6
rows, greedy tokens equal to transformers' generate) is in test_layer_loop.py and
test_cpu_backend.py."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from executor_svc.packed_linear import onednn_packs_bfloat16, pack_weight

NONE, SILU, TIMES = 0, 1, 2  # small_rows_linear's epilogue argument, as documented
# float32's sums run in another order than float64's; in bf16 (8 significant bits) that can
# round the result to the neighbouring value: one ulp, 2^-7 of it.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}


def test_small_rows_linear_exports_its_epilogue_values(kernel: ModuleType) -> None:
    # OneDnnWeight passes these by name; the documented values are the kernel's.
    assert (kernel.EPILOGUE_NONE, kernel.EPILOGUE_SILU, kernel.EPILOGUE_TIMES) == (NONE, SILU,
                                                                                   TIMES)


def _reference(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None,
               epilogue: int, other: torch.Tensor | None) -> torch.Tensor:
    """In float64 from the same (rounded) inputs, rounded once to x's dtype at the end."""
    out = x.double() @ torch.cat(weights).double().T
    if bias is not None:
        out = out + bias.double()
    if epilogue == SILU:
        out = F.silu(out)
    elif epilogue == TIMES:
        assert other is not None
        out = out * other.double()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [64, 100, 576])  # 100: a tail after the last full vector
def test_small_rows_linear_matches_float64(kernel: ModuleType, dtype: torch.dtype, rows: int,
                                           k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n in (7, 1, 13)]  # odd widths
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(21, generator=gen).to(dtype)
    other = torch.randn(rows, 21, generator=gen).to(dtype)
    for epilogue, with_bias, factor in ((NONE, False, None), (NONE, True, None),
                                        (SILU, False, None), (TIMES, True, other)):
        got = kernel.small_rows_linear(x, weights, bias if with_bias else None, epilogue, factor)
        expected = _reference(x, weights, bias if with_bias else None, epilogue, factor)
        assert got.dtype == dtype and got.shape == (rows, 21)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_rows_linear_bits_do_not_depend_on_threads_or_grouping(
        kernel: ModuleType, dtype: torch.dtype) -> None:
    # Each output is one thread's dot product in a fixed order: q/k/v side by side give the
    # bits of three calls, with one thread or two (the Python loop and the stack must agree).
    gen = torch.Generator().manual_seed(3)
    # Widths that leave a partial block of rows at each weight's end.
    weights = [torch.randn(n, 576, generator=gen).to(dtype) for n in (577, 190, 193)]
    x = torch.randn(3, 576, generator=gen).to(dtype)
    together = kernel.small_rows_linear(x, weights)
    apart = torch.cat([kernel.small_rows_linear(x, [w]) for w in weights], dim=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel.small_rows_linear(x, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, apart) and torch.equal(together, alone)


def test_small_rows_linear_reads_strided_rows(kernel: ModuleType) -> None:
    # q, k and v are views of one wider projection: rows at a stride, each unit-strided.
    wide = torch.randn(2, 96)
    weight = torch.randn(5, 32)
    got = kernel.small_rows_linear(wide[:, 32:64], [weight])
    torch.testing.assert_close(got, F.linear(wide[:, 32:64], weight), rtol=1e-5, atol=1e-5)


def _bad_calls() -> list[tuple[str, dict[str, object], str]]:
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    return [
        ("no rows", {"x": torch.randn(0, 8)}, "takes 1 to 4 rows, got 0"),
        ("five rows", {"x": torch.randn(5, 8)}, "takes 1 to 4 rows, got 5"),
        ("float64", {"x": x.double()}, "x must be float32 or bfloat16"),
        ("1-D x", {"x": torch.randn(8)}, "x must be [M, K], each row unit-strided"),
        ("column-strided x", {"x": torch.randn(8, 2).T}, "x must be [M, K], each row unit"),
        ("no weight", {"weights": []}, "small_rows_linear needs a weight"),
        ("other K", {"weights": [torch.randn(3, 9)]}, "each weight must be [N, K] of x's K"),
        ("other dtype", {"weights": [w.bfloat16()]}, "each weight must be [N, K] of x's K"),
        ("strided weight", {"weights": [torch.randn(8, 3).T]}, "each weight must be [N, K]"),
        ("bad epilogue", {"epilogue": 3}, "the epilogue must be 0 (none), 1 (SiLU) or 2"),
        ("times alone", {"epilogue": TIMES}, "`other` goes with the times epilogue"),
        ("other alone", {"other": torch.randn(2, 3)}, "`other` goes with the times epilogue"),
        ("other's shape", {"epilogue": TIMES, "other": torch.randn(2, 4)},
         "`other` must be [M, sum N], contiguous"),
        ("bias's shape", {"bias": torch.randn(4)}, "the bias must be [sum N], contiguous"),
        ("bias's dtype", {"bias": torch.randn(3).double()}, "the bias must be [sum N]"),
    ]


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in _bad_calls()],
                         ids=[name for name, _, _ in _bad_calls()])
def test_small_rows_linear_refuses_bad_inputs(kernel: ModuleType, change: dict[str, object],
                                              message: str) -> None:
    call: dict[str, object] = {"x": torch.randn(2, 8), "weights": [torch.randn(3, 8)],
                               "bias": None, "epilogue": NONE, "other": None}
    call.update(change)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernel.small_rows_linear(**call)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_weight_reads_the_plain_weight_for_a_few_rows_only(
        kernel: ModuleType, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not onednn_packs_bfloat16():
        pytest.skip("needs a CPU with oneDNN bfloat16 kernels (AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT; see lscpu): run `.venv/bin/python -m pytest "
                    "tests/executor/test_small_gemm.py` on one")
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 64, generator=gen).to(dtype)
    with_kernels, without = pack_weight(weight, kernel), pack_weight(weight)
    assert with_kernels is not None and without is not None
    assert kernel.SMALL_ROWS_MAX == 4
    gate, other = torch.randn(6, 40, generator=gen).to(dtype), None
    for rows in range(1, 7):
        x = torch.randn(1, rows, 64, generator=gen).to(dtype)  # [1, T, K], as the loop's
        onednn = torch.ops.mkldnn._linear_pointwise(x, with_kernels.packed, None, "none", [], "")
        expected = kernel.small_rows_linear(x[0], [weight])[None] if rows <= 4 else onednn
        assert torch.equal(with_kernels.linear(x, None), expected)
        assert torch.equal(without.linear(x, None), onednn)  # no kernels: oneDNN throughout
        other = gate[:rows][None]
        if rows <= 4:
            assert torch.equal(with_kernels.linear_silu(x),
                               kernel.small_rows_linear(x[0], [weight], None, SILU)[None])
            assert torch.equal(with_kernels.linear_times(x, other), kernel.small_rows_linear(
                x[0], [weight], None, TIMES, other[0])[None])
        else:
            assert torch.equal(with_kernels.linear_silu(x), without.linear_silu(x))
            assert torch.equal(with_kernels.linear_times(x, other), without.linear_times(x, other))
    empty = torch.empty(1, 0, 64, dtype=dtype)  # no rows: oneDNN's empty product, no refusal
    assert with_kernels.linear(empty, None).shape == (1, 0, 40)
