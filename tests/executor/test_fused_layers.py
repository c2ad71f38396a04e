"""The fused CPU layers (fused_layers.py, cpu_kernels/csrc/fused_ops.cpp) against transformers'
own modules and functions. Whole-model parity (fused layers inside the executor, greedy tokens
equal to transformers' generate) is in test_runner.py, test_cpu_backend.py and tests/e2e."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

from executor_svc.cpu_kernels import BUILD_DIR, native_cpu, source_digest
from executor_svc.fused_layers import (
    FusedRMSNorm,
    FusedRotaryAttention,
    FusedSiluMLP,
    fuse_layers,
)
from executor_svc.model_loader import load_model
from executor_svc.runner import build_runner

from .oracle import MODELS, make_settings, reference_model


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rms_norm(kernel, rows: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = _generator(rows)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    got = FusedRMSNorm(norm, kernel)(x)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # float rounding; one bf16 ulp
    torch.testing.assert_close(got, norm(x), rtol=tolerance, atol=tolerance)


def test_rms_norm_reads_strided_rows_and_keeps_leading_dims(kernel) -> None:  # type: ignore[no-untyped-def]
    gen = _generator(1)
    norm = LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    wide = torch.randn(7, 200, generator=gen)
    rows = wide[:, 10:74]  # each row unit-strided, rows 200 apart
    torch.testing.assert_close(kernel.rms_norm(rows, norm.weight, 1e-6), norm(rows))
    packed = torch.randn(1, 9, 64, generator=gen)  # the model's [1, T, H]
    got = FusedRMSNorm(norm, kernel)(packed)
    assert got.shape == packed.shape
    torch.testing.assert_close(got, norm(packed))


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_silu_mul_matches_silu_times_up(kernel, rows: int) -> None:  # type: ignore[no-untyped-def]
    gen = _generator(rows)
    gate = torch.randn(rows, 257, generator=gen) * 4  # odd width: the vector loop's tail
    up = torch.randn(rows, 257, generator=gen)
    torch.testing.assert_close(kernel.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("tokens", "q_heads", "k_heads", "dim"), [(1, 9, 3, 64), (37, 4, 1, 16)])
def test_rotary_matches_apply_rotary_pos_emb(kernel, tokens, q_heads, k_heads, dim) -> None:  # type: ignore[no-untyped-def]
    gen = _generator(tokens)
    q = torch.randn(1, tokens, q_heads, dim, generator=gen)
    k = torch.randn(1, tokens, k_heads, dim, generator=gen)
    angles = torch.randn(1, tokens, dim // 2, generator=gen) * 10
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # [1, T, D] as the model makes them
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = q.clone(), k.clone()
    kernel.rotary_(got_q[0], got_k[0], cos[0], sin[0])
    torch.testing.assert_close(got_q, want_q.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_kernels_refuse_wrong_dtypes_and_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="unit-strided"):
        kernel.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul takes float32"):
        kernel.silu_mul(x.bfloat16(), x.bfloat16())
    with pytest.raises(RuntimeError, match="share one shape"):
        kernel.silu_mul(x, torch.randn(4, 9))
    q, k, cs = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="disagree"):
        kernel.rotary_(q, torch.randn(2, 1, 8), cs, cs)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.rotary_(q.bfloat16(), k.bfloat16(), cs.bfloat16(), cs.bfloat16())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_executor_model_is_fused_and_keeps_its_state_dict(preset: str) -> None:
    runner = build_runner(make_settings(preset))
    model = runner.loaded.model
    layers = model.config.num_hidden_layers
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(FusedRMSNorm) == 2 * layers + 1  # two a layer, and the final norm
    assert kinds.count(FusedSiluMLP) == layers
    assert kinds.count(FusedRotaryAttention) == layers
    reference = reference_model(runner)  # loads the fused model's state_dict: names unchanged
    assert set(reference.state_dict()) == set(model.state_dict())


def test_bfloat16_fuses_norms_only_and_mlp_falls_back(kernel) -> None:  # type: ignore[no-untyped-def]
    runner = build_runner(make_settings("tiny-llama", dtype="bfloat16"))
    kinds = [type(m) for m in runner.loaded.model.modules()]
    assert FusedRotaryAttention not in kinds  # the rotary kernel is float32 only
    mlp = next(m for m in runner.loaded.model.modules() if isinstance(m, FusedSiluMLP))
    x = torch.randn(1, 3, mlp.gate_proj.in_features, dtype=torch.bfloat16)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)  # the same torch ops


def test_fuse_layers_leaves_unknown_classes_alone(kernel) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    assert fuse_layers(model, kernel) == 0  # type: ignore[arg-type]
    assert [type(m) for m in model] == [torch.nn.LayerNorm, torch.nn.Linear]


def test_a_fused_model_refuses_another_attention_and_an_unfused_one_switches() -> None:
    fused = build_runner(make_settings("tiny-llama")).loaded.model
    fused.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="fused_layers=False"):
        fused(torch.tensor([[1, 2, 3]]))
    plain = load_model(str(MODELS / "tiny-llama"), "dummy", "float32", "cpu", 1234,
                       fused_layers=False).model
    assert not any(type(m).__name__.startswith("Fused") for m in plain.modules())
    plain.set_attn_implementation("sdpa")
    reference = reference_model(build_runner(make_settings("tiny-llama")))
    with torch.inference_mode():
        torch.testing.assert_close(
            plain(torch.tensor([[1, 2, 3]])).logits, reference(torch.tensor([[1, 2, 3]])).logits
        )


def test_the_kernels_load_from_a_build_directory_named_by_their_sources(kernel) -> None:  # type: ignore[no-untyped-def]
    digest = source_digest()
    assert len(digest) == 12 and digest == source_digest()
    assert Path(kernel.__file__).parent == BUILD_DIR / digest


def test_a_build_for_another_cpu_is_in_another_directory() -> None:
    # Built with -march=native: an AVX-512 build must never load on an AVX2-only CPU.
    here = native_cpu()
    assert here and source_digest() == source_digest(cpu=here)
    elsewhere = here.replace(" avx512f", "") + " (another CPU)"
    assert source_digest(cpu=elsewhere) != source_digest()
