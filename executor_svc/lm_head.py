"""The output projection (lm_head) on CPU: the largest matmul of a decode step, made cheaper.

Torch's fp32 linear on CPU calls MKL's sgemm on a [vocab, hidden] weight, re-laying it out on
every call (figures: bench/README.md, "Executor CPU kernels"). So the weight is stored
[hidden, vocab] (same values, read through a transpose) and also packed once for oneDNN,
through the ops torch itself uses for CPU inference (packed_linear.py); on Intel CPUs a step
with fewer than PACKED_MIN_ROWS rows uses the stored weight (MKL's sgemm). Elsewhere MKL runs
its slow generic code (a lone row 4.1 ms against oneDNN's 1.9 on an AMD EPYC,
bench.matmul_libraries), and oneDNN serves every row count. Logits agree with nn.Linear within float
rounding (about 1e-6). (In bfloat16 the head is packed with every other linear layer by
packed_linear.pack_linears.)

Tied embeddings (SmolLM2) keep theirs for the embedding lookup, which reads rows, and the head
gets its own copy, stored and packed as above (113 MB more for SmolLM2-135M).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from executor_svc.packed_linear import PackedLinear, matmul_library, pack_weight

PACKED_MIN_ROWS = 4  # below this, MKL's sgemm on the [hidden, vocab] weight is faster


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
    packed = pack_weight(head.weight)
    if packed is not None:
        min_rows = PACKED_MIN_ROWS if matmul_library() == "mkl" else 1
        model.set_output_embeddings(PackedLinear(head, packed, min_rows, None))
