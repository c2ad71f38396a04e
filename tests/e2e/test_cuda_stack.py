"""The whole stack with its executor on CUDA, against transformers on CUDA (lent GPU only).

fp32 with the torch backend must give transformers' greedy tokens exactly, over concurrent
prompts that share a prefix, in chunks. bf16 with FlashInfer is reported, not asserted, by
`python -m bench.gpu --stage parity` (bf16 rounding parts the two ways after near-ties).
Skipped with a message where no CUDA device is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_stack import DUMMY_SEED, MODEL, Clients, generate_many, prompts, sampling, start_stack
from transformers import AutoConfig, GenerationConfig

from executor_svc.model_loader import dummy_model
from pagedkv.gateway.v1 import gateway_pb2 as gpb

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False); on a lent GPU "
                    "machine: bash tools/gpu_check.sh (or python -m pytest -m gpu tests/e2e)")


def test_cuda_stack_greedy_equals_transformers_on_cuda(tmp_path: Path) -> None:
    _require_cuda()
    shared = next(prompts(1, 40, seed=7))
    batch = [*prompts(6, 70, seed=8), *(shared + p[1:] for p in prompts(6, 30, seed=9))]
    stack = start_stack(tmp_path, executor_args=(
        "--load-format", "dummy", "--seed", str(DUMMY_SEED), "--device", "cuda",
        "--dtype", "float32", "--backend", "torch", "--gpu-memory-utilization", "0.3",
        "--max-num-batched-tokens", "64"), gateway_args=("--max-num-batched-tokens", "64"))
    clients = Clients(stack)
    try:
        done = generate_many(clients.gateway, [
            gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p),
                                sampling=sampling(32, ignore_eos=True)) for p in batch])
        config = AutoConfig.from_pretrained(MODEL, local_files_only=True)
        model = dummy_model(config, torch.float32, DUMMY_SEED, "sdpa").to("cuda").eval()
        generation = GenerationConfig(max_new_tokens=32, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)
        for prompt, streamed in zip(batch, done, strict=True):
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt], device="cuda"),
                                     generation_config=generation)
            assert streamed[0].token_ids == out[0, len(prompt):].tolist()
        clients.wait_all_blocks_back()
    finally:
        clients.close()
        stack.stop()
