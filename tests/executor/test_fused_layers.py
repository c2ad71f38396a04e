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

from executor_svc.cpu_kernels import BUILD_DIR, MARCH, native_cpu, source_digest
from executor_svc.fused_layers import (
    FusedRMSNorm,
    FusedRotaryAttention,
    FusedSiluMLP,
    fuse_layers,
)
from executor_svc.model_loader import load_model
from executor_svc.packed_linear import onednn_packs_bfloat16
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


def test_rotary_reads_q_and_k_as_views_of_one_projection(kernel) -> None:  # type: ignore[no-untyped-def]
    # q, k and v side by side in one [T, (Hq + 2 Hkv) D] buffer (the fused projection): the
    # kernel rotates q and k in place through their token stride, as it rotates contiguous
    # copies (tested against transformers above), and leaves v alone.
    gen = _generator(11)
    tokens, q_heads, k_heads, dim = 5, 4, 2, 16
    fused = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen)
    q, k, v = (p.unflatten(-1, (-1, dim)) for p in
               fused.split([q_heads * dim, k_heads * dim, k_heads * dim], dim=-1))
    cos, sin = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
    want_q, want_k, want_v = q.clone(), k.clone(), v.clone()
    kernel.rotary_(want_q, want_k, cos, sin)  # contiguous copies
    kernel.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)


def _within_two_bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results equal to torch's but where the kernel's float32 exp differs from torch's
    by enough to round silu the other way: one unit in bf16's last place, which the product's
    own rounding can make two."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    exact = (got == want).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of the elements equal torch's"
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
    assert bool(((got.float() - want.float()).abs() <= 2 * ulp).all())


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_silu_mul_matches_silu_times_up(kernel, rows: int) -> None:  # type: ignore[no-untyped-def]
    gen = _generator(rows)
    gate = torch.randn(rows, 257, generator=gen) * 4  # odd width: the vector loop's tail
    up = torch.randn(rows, 257, generator=gen)
    torch.testing.assert_close(kernel.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_in_bfloat16_rounds_where_torch_rounds(kernel, rows: int) -> None:  # type: ignore[no-untyped-def]
    # F.silu(gate) * up on bf16 tensors rounds silu's result to bf16 before the product: the
    # kernel does too, so all but a few elements (exp's last float bit) are equal.
    gen = _generator(rows)
    gate = (torch.randn(rows, 1537, generator=gen) * 4).bfloat16()
    up = torch.randn(rows, 1537, generator=gen).bfloat16()
    _within_two_bf16_ulps(kernel.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize(("tokens", "q_heads", "k_heads", "dim"), [(1, 9, 3, 64), (37, 4, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_apply_rotary_pos_emb(kernel, tokens, q_heads, k_heads, dim, dtype) -> None:  # type: ignore[no-untyped-def]
    # bf16: each product rounded to bf16 before the sum, as torch's ops on bf16 tensors round,
    # so the kernel's results are torch's exactly.
    gen = _generator(tokens)
    q = torch.randn(1, tokens, q_heads, dim, generator=gen).to(dtype)
    k = torch.randn(1, tokens, k_heads, dim, generator=gen).to(dtype)
    angles = torch.randn(1, tokens, dim // 2, generator=gen) * 10
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)  # [1, T, D] as the model
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)  # makes them
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = q.clone(), k.clone()
    kernel.rotary_(got_q[0], got_k[0], cos[0], sin[0])
    tolerance = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(got_q, want_q.transpose(1, 2), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2), rtol=tolerance, atol=tolerance)


def test_kernels_refuse_wrong_dtypes_and_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="unit-strided"):
        kernel.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.silu_mul(x.double(), x.double())
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernel.silu_mul(x, x.bfloat16())
    with pytest.raises(RuntimeError, match="share one shape"):
        kernel.silu_mul(x, torch.randn(4, 9))
    q, k, cs = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="disagree"):
        kernel.rotary_(q, torch.randn(2, 1, 8), cs, cs)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.rotary_(q.double(), k.double(), cs.double(), cs.double())
    with pytest.raises(RuntimeError, match="tensors of one dtype"):
        kernel.rotary_(q, k.bfloat16(), cs, cs)
    with pytest.raises(RuntimeError, match="each token's heads contiguous"):
        kernel.rotary_(q.transpose(0, 1), k, cs, cs)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        kernel.rotary_(q, k, torch.randn(8, 3).t(), cs)


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


def test_bfloat16_fuses_every_layer_kind_within_bf16_rounding_of_transformers(kernel) -> None:  # type: ignore[no-untyped-def]
    # The MLP's SiLU and product run in the oneDNN matmuls' epilogues where this CPU has
    # oneDNN's bf16 kernels (else in silu_mul): two roundings where transformers has four, so
    # within a bf16 step or two of LlamaMLP's own forward, decode and prefill row counts.
    runner = build_runner(make_settings("tiny-llama", dtype="bfloat16"))
    kinds = [type(m) for m in runner.loaded.model.modules()]
    layers = runner.loaded.model.config.num_hidden_layers
    assert kinds.count(FusedRotaryAttention) == kinds.count(FusedSiluMLP) == layers
    mlp = next(m for m in runner.loaded.model.modules() if isinstance(m, FusedSiluMLP))
    assert (mlp.epilogues is not None) == onednn_packs_bfloat16()
    modules = list(runner.loaded.model.modules())
    attention = next(m for m in modules if isinstance(m, FusedRotaryAttention))
    assert (attention.qkv is not None) == onednn_packs_bfloat16()  # one q/k/v matmul
    for rows in (1, 3, 300):
        x = torch.randn(1, rows, mlp.gate_proj.in_features, generator=_generator(rows)).bfloat16()
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))  # LlamaMLP's forward
        torch.testing.assert_close(mlp(x), want, rtol=2e-2, atol=2e-2)


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
    # Built with -march=native an AVX-512 build must never load on an AVX2-only CPU; built for
    # a named portable level (PAGEDKV_KERNEL_MARCH) one build serves every CPU.
    here = native_cpu()
    assert here and source_digest() == source_digest(cpu=here)
    elsewhere = here.replace(" avx512f", "") + " (another CPU)"
    assert (source_digest(cpu=elsewhere) != source_digest()) == (MARCH == "native")
