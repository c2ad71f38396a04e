"""bench.floor_share's per-step floor: the larger of its FLOPs at the peak and its bytes at the
bandwidth, counted by hand for a toy model."""

from __future__ import annotations

from bench.floor_share import ModelShape, step_floor
from executor_svc.step import SequenceWork, StepRequest

# 2 layers, hidden 4, 2 query heads and 1 K/V head of dim 2, vocabulary 10, 2-byte elements.
SHAPE = ModelShape(layers=2, hidden=4, q_heads=2, kv_heads=1, head_dim=2, vocab=10,
                   element_bytes=2, linear_shapes=((4, 4), (4, 2), (4, 2), (4, 4)))


def test_step_floor_counts_matmuls_attention_weights_and_kv() -> None:
    # A 3-token prompt (sampled) and a decode row after 9 cached tokens.
    step = StepRequest(seqs=(SequenceWork("a", (1, 2, 3), 0, sample=True),
                             SequenceWork("b", (4,), 9, sample=True)))
    # Weights per layer 16 + 8 + 8 + 16 = 48. Rows 4, sampled 2, pairs 6 + 10 = 16.
    flops = 2 * 4 * 48 * 2 + 2 * 2 * 10 * 4 + 4 * 2 * 2 * 16 * 2  # 768 + 160 + 512
    # Bytes: weights (96 + 40) x 2; K/V per token 2 x 1 x 2 x 2 x 2 = 16, read for 3 + 10
    # tokens of context and written for 4 rows.
    moved = 136 * 2 + 13 * 16 + 4 * 16  # 272 + 208 + 64
    assert step_floor(step, SHAPE, peak_flops=1.0, bandwidth=1e9) == (flops, True)
    assert step_floor(step, SHAPE, peak_flops=1e9, bandwidth=1.0) == (moved, True)
    decode_only = StepRequest(seqs=(SequenceWork("b", (4,), 9),))
    assert step_floor(decode_only, SHAPE, 1.0, 1e9)[1] is False
