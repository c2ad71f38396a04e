"""The CPU lm_head: packed for oneDNN, same parameters, same logits as nn.Linear."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from executor_svc.lm_head import PACKED_MIN_ROWS, speed_up_lm_head
from executor_svc.packed_linear import PackedLinear

from .oracle import MODELS


def _model(tied: bool) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(MODELS / "tiny-llama")
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.requires_grad_(False)
    return model


def test_lm_head_packed_matches_linear_on_few_and_many_rows(matmul_library: str) -> None:
    # One row (the stored weight through MKL on Intel CPUs, oneDNN's packed one elsewhere) and
    # 16 rows (oneDNN's) give nn.Linear's logits.
    model = _model(tied=False)
    linear = model.lm_head
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}
    speed_up_lm_head(model)
    if not torch.backends.mkldnn.is_available():
        assert isinstance(model.lm_head, torch.nn.Linear)
        return
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.min_rows == (PACKED_MIN_ROWS if matmul_library == "mkl" else 1)
    for rows in (1, PACKED_MIN_ROWS, 16):
        hidden = torch.randn(1, rows, linear.in_features)  # [1, S, H]
        torch.testing.assert_close(model.lm_head(hidden), linear(hidden), rtol=1e-5, atol=1e-5)
    state = model.state_dict()
    assert list(state) == list(expected_state)
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())


def test_lm_head_tied_gets_its_own_packed_copy_and_the_embedding_is_kept() -> None:
    # A tied head: the embedding keeps its Parameter untouched; the head becomes a packed copy
    # with the same values, giving the tied nn.Linear's logits.
    model = _model(tied=True)
    embed = model.get_input_embeddings()
    before = embed.weight.clone()
    linear = torch.nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    linear.weight = torch.nn.Parameter(before.clone())
    speed_up_lm_head(model)
    assert model.get_input_embeddings() is embed and torch.equal(embed.weight, before)
    expected_type = PackedLinear if torch.backends.mkldnn.is_available() else torch.nn.Linear
    assert isinstance(model.lm_head, expected_type)
    assert model.lm_head.weight.data_ptr() != embed.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, before)
    for rows in (1, 16):
        hidden = torch.randn(1, rows, embed.embedding_dim)  # [1, S, H]
        torch.testing.assert_close(model.lm_head(hidden), linear(hidden), rtol=1e-5, atol=1e-5)
