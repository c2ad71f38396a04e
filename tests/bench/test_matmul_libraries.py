"""bench.matmul_libraries times what it says: each library's call computes x @ w^T."""

from __future__ import annotations

import pytest
import torch

from bench.matmul_libraries import linears


@pytest.mark.parametrize("library", ["f_linear", "mkl", "onednn", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_library_computes_the_linear_layer_or_says_it_cannot(library: str,
                                                                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 48, generator=gen).to(dtype) for n in (32, 80)]
    calls = linears(library, weights)
    if calls is None:  # MKL's packed GEMM is float32 only; oneDNN's bf16 needs AVX-512
        assert library == "mkl" and dtype == torch.bfloat16 or (
            library == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return
    x = torch.randn(3 if library == "small" else 5, 48, generator=gen).to(dtype)  # small: 1-4
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for call, weight in zip(calls, weights, strict=True):
        torch.testing.assert_close(call(x).float(), torch.nn.functional.linear(x, weight).float(),
                                   rtol=tolerance, atol=tolerance)
