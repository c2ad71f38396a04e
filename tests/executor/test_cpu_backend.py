"""The CPU backend's C++ decode kernel against the torch reference decode (gather + SDPA)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from executor_svc.attention.cpu_backend import KERNEL_DTYPES, CpuBackend, KernelFreshPrefill
from executor_svc.attention.metadata import SeqSpan
from executor_svc.attention.torch_backend import TorchBackend
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.runner import ModelRunner

from .oracle import (
    Driver,
    built_kernels,
    random_prompts,
    reference_generate,
    reference_model,
)


def _decode_both(
    num_kv_heads: int, group: int, head_dim: int, block_size: int, lengths: list[int], seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode layer over scattered blocks, by the reference and by the kernel."""
    gen = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, dtype)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    cache = KVCache.allocate(spec, num_blocks, 0, torch.device("cpu"))
    cache.kv.normal_(generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered tables
    spans, start = [], 0
    for i, n in enumerate(lengths):
        count = -(-n // block_size)
        spans.append(SeqSpan(i, 1, n, tuple(order[start : start + count])))
        start += count
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    outs = []
    for backend in (TorchBackend(), CpuBackend(built_kernels())):
        out = torch.full_like(q, float("nan"))
        decode = backend.plan_decode(spans, block_size, cache)
        decode.run(cache.layer_kv(0), q, out, head_dim**-0.5)
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (2, 2, 16, 16), (1, 4, 24, 1), (2, 1, 32, 32), (8, 4, 128, 16)],
)
def test_cpu_backend_decode_kernel_matches_reference(
    num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    # Grouped heads, head dims with and without a 16-lane remainder (64 and 128: the kernel's
    # fixed-size path), block sizes 1..32, contexts of 1 token up to several blocks: within
    # float rounding of gather + SDPA.
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 200]
    reference, kernel = _decode_both(num_kv_heads, group, head_dim, block_size, lengths, seed=3)
    torch.testing.assert_close(kernel, reference, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (2, 2, 24)]
)
def test_cpu_backend_decode_kernel_bfloat16_within_bf16_rounding_of_reference(
    num_kv_heads: int, group: int, head_dim: int
) -> None:
    # bfloat16 cache and queries: the kernel sums in float32, the reference SDPA in bf16; both
    # agree to bf16's resolution (8 bits of mantissa) on outputs of magnitude ~1. Head dims 64
    # and 128 take the kernel's fixed-size path, 24 its general one.
    lengths = [1, 7, 16, 17, 120, 300]
    reference, kernel = _decode_both(num_kv_heads, group, head_dim, 16, lengths, seed=4,
                                     dtype=torch.bfloat16)
    assert kernel.dtype == torch.bfloat16
    torch.testing.assert_close(kernel.float(), reference.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 3, 12])
def test_decode_kernel_tasks_per_head_and_per_sequence_agree_with_reference(
    threads: int, num_seqs: int
) -> None:
    # The kernel splits a step into one task per KV head while sequences are fewer than two per
    # thread, else one per sequence: both shapes of task, on one and two threads, match the
    # reference (fp32 and bf16, head dims 64 and 128 on the fixed path, 24 on the general one,
    # grouped heads and one query head per KV head).
    lengths = [(37 * i) % 230 + 1 for i in range(num_seqs)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kv_heads, group, head_dim, dtype, tolerance in [
            (3, 3, 64, torch.float32, 2e-5), (2, 2, 128, torch.float32, 2e-5),
            (3, 3, 24, torch.float32, 2e-5), (3, 1, 64, torch.float32, 2e-5),
            (3, 3, 64, torch.bfloat16, 2e-2), (2, 3, 24, torch.bfloat16, 2e-2),
        ]:
            reference, kernel = _decode_both(kv_heads, group, head_dim, 16, lengths,
                                             seed=num_seqs, dtype=dtype)
            torch.testing.assert_close(kernel.float(), reference.float(), atol=tolerance,
                                       rtol=tolerance)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("context_len", "block_id", "message"),
    [(0, 1, "context length"), (33, 1, "context length"), (20, 99, "block id"),
     (20, -1, "block id")],
)
def test_decode_kernel_refuses_lengths_and_blocks_outside_its_tables(
    context_len: int, block_id: int, message: str
) -> None:
    # A context of no token or past its table's two blocks, a block id outside the cache: a
    # clear error, never a read outside the tensors.
    key = torch.randn(8, 16, 1, 64)
    q = torch.randn(1, 2, 64)
    tables = torch.tensor([[2, block_id]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        built_kernels().paged_decode_attention(
            torch.empty_like(q), q, torch.tensor([0]), key, key.clone(), tables,
            torch.tensor([context_len], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_and_writes_rows_by_stride(head_dim: int, dtype: torch.dtype) -> None:
    # The model hands the kernel q as a view of the fused q/k/v projection and out as rows of
    # a wider buffer: the fixed-size path reads and writes them by stride, equal to the same
    # rows made contiguous, and leaves the rest of each row alone.
    num_kv_heads, group, block_size, lengths = 2, 3, 16, [1, 17, 90]
    gen = torch.Generator().manual_seed(9)
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, dtype)
    cache = KVCache.allocate(spec, 12, 0, torch.device("cpu"))
    cache.kv.normal_(generator=gen)
    spans, start = [], 0
    for i, n in enumerate(lengths):
        count = -(-n // block_size)
        spans.append(SeqSpan(i, 1, n, tuple(range(start, start + count))))
        start += count
    width = num_kv_heads * group * head_dim
    fused = torch.randn(len(lengths), width + 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    q = fused[:, :width].unflatten(-1, (-1, head_dim))  # [N, Hq, D], rows fused.shape[1] apart
    wide_out = torch.full((len(lengths), width + 5), float("nan"), dtype=dtype)
    out = wide_out[:, :width].unflatten(-1, (-1, head_dim))
    decode = CpuBackend(built_kernels()).plan_decode(spans, block_size, cache)
    decode.run(cache.layer_kv(0), q, out, head_dim**-0.5)
    packed = torch.empty(q.shape, dtype=dtype)
    decode.run(cache.layer_kv(0), q.contiguous(), packed, head_dim**-0.5)
    assert torch.equal(out, packed)
    assert bool(wide_out[:, width:].isnan().all())


def test_cpu_backend_is_the_default_on_cpu(make_runner: Callable[..., ModelRunner]) -> None:
    # --backend auto picks the kernel backend on CPU (it builds here: make setup built it).
    assert make_runner("tiny-llama").info.backend == "cpu"


@pytest.mark.parametrize(("preset", "lengths", "num_blocks"), [
    # One 1,500-token prompt beside short ones, decoded by the decode kernel (head dim 24:
    # its prompts through SDPA).
    ("tiny-qwen2", [1500, 3, 9, 40], 512),
    # Prompts of several lengths prefilled together by the prefill kernel (head dim 128).
    ("tiny-llama-hd128", [70, 3, 33, 9], 256),
])
def test_cpu_backend_greedy_matches_generate(
    make_runner: Callable[..., ModelRunner], preset: str, lengths: list[int], num_blocks: int,
) -> None:
    # The same tokens as transformers' generate.
    runner = make_runner(preset, num_blocks=num_blocks, backend="cpu")
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, lengths, seed=5)
    got = Driver.scattered(runner).generate({f"r{i}": p for i, p in enumerate(prompts)}, 8)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_generate(reference, prompt, 8), f"prompt {i}"


def _fresh_both(
    num_kv_heads: int, group: int, head_dim: int, lengths: list[int], dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh prompts packed back to back after 2 rows of no prompt (a step's decode rows come
    first) and before 3 more, through torch's grouped SDPA calls and through the kernel; the
    two outputs, NaN where no prompt wrote, and the kernel's q, laid out as the model hands
    it over (a transposed view)."""
    gen = torch.Generator().manual_seed(seed)
    total = 2 + sum(lengths) + 3
    spans, start = [], 2
    for n in lengths:
        spans.append(SeqSpan(start, n, n, ()))  # no cached prefix: context = its own rows
        start += n
    q = torch.randn(num_kv_heads * group, total, head_dim, generator=gen).to(dtype).transpose(0, 1)
    k, v = (torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    spec = KVCacheSpec(1, num_kv_heads, head_dim, 16, dtype)
    cache = KVCache.allocate(spec, 4, 0, torch.device("cpu"))
    outs = []
    for backend in (TorchBackend(), CpuBackend(built_kernels(), KERNEL_DTYPES)):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        planned = backend.plan_fresh(spans, cache)
        assert isinstance(planned[0], KernelFreshPrefill) == isinstance(backend, CpuBackend)
        for fresh in planned:
            fresh.run(q, k, v, out, head_dim**-0.5)
        outs.append(out)
    return outs[0], outs[1], q


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (2, 4, 128), (4, 1, 64)])
def test_prefill_kernel_matches_sdpa_for_prompts_without_a_cached_prefix(
    num_kv_heads: int, group: int, head_dim: int
) -> None:
    # Prompts of 1 token to several of the kernel's 32-row blocks (31, 32, 33 at its edges),
    # grouped queries or not: within float rounding of torch's SDPA per group of prompts;
    # rows of no prompt untouched.
    lengths = [1, 5, 31, 32, 33, 100, 300]
    reference, kernel, _ = _fresh_both(num_kv_heads, group, head_dim, lengths, torch.float32, 4)
    torch.testing.assert_close(kernel, reference, atol=2e-5, rtol=1e-5, equal_nan=True)
    assert bool(kernel[:2].isnan().all()) and bool(kernel[2 + sum(lengths):].isnan().all())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_bfloat16_within_bf16_rounding_of_sdpa(head_dim: int) -> None:
    # bf16 rows, float32 arithmetic, the output rounded once: within a bf16 step of SDPA's
    # (both round a float32 result).
    lengths = [7, 64, 129]
    reference, kernel, _ = _fresh_both(3, 3, head_dim, lengths, torch.bfloat16, 5)
    rows = slice(2, 2 + sum(lengths))
    torch.testing.assert_close(kernel[rows].float(), reference[rows].float(), atol=2e-2,
                               rtol=2e-2)


def test_prefill_kernel_is_planned_for_its_dtypes_and_head_dims_only() -> None:
    # bf16 too, but not where AMX computes it for torch's flash attention (unmeasured there).
    spans = [SeqSpan(0, 20, 20, ()), SeqSpan(20, 5, 5, ())]
    backend = CpuBackend(built_kernels())
    amx = torch.cpu._is_amx_tile_supported()
    for dtype, head_dim, kernel in ((torch.float32, 64, True), (torch.bfloat16, 128, not amx),
                                    (torch.float32, 32, False), (torch.float16, 64, False)):
        cache = KVCache.allocate(KVCacheSpec(1, 2, head_dim, 16, dtype), 4, 0,
                                 torch.device("cpu"))
        planned = backend.plan_fresh(spans, cache)
        assert isinstance(planned[0], KernelFreshPrefill) == kernel


@pytest.mark.parametrize(("change", "message"), [
    ("dtype", "q, k, v and out must share one dtype"),
    ("double", "prefill_attention takes float32 or bfloat16 rows"),
    ("head_dim", "prefill_attention takes head dims 64 and 128"),
    ("heads", "the query heads must be a multiple of the KV heads"),
    ("outside", "a prompt's rows are outside q"),
    ("negative", "a prompt's rows are outside q"),
    ("lengths", "starts and lengths must be [P] int64, contiguous"),
    ("stride", "each head's D must be unit-strided"),
])
def test_prefill_kernel_refuses_bad_inputs(change: str, message: str) -> None:
    kernel = built_kernels()
    head_dim = 80 if change == "head_dim" else 64
    q = torch.randn(10, 6 if change != "heads" else 5, head_dim)
    k, v = torch.randn(10, 2, head_dim), torch.randn(10, 2, head_dim)
    out = torch.empty_like(q)
    starts, lengths = torch.tensor([0, 4]), torch.tensor([4, 6])
    if change == "dtype":
        k = k.bfloat16()
    elif change == "double":
        q, k, v, out = q.double(), k.double(), v.double(), out.double()
    elif change == "outside":
        lengths = torch.tensor([4, 7])
    elif change == "negative":
        starts = torch.tensor([-1, 4])
    elif change == "lengths":
        lengths = lengths.int()
    elif change == "stride":
        q = torch.randn(10, 6, 2 * head_dim)[:, :, ::2]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernel.prefill_attention(out, q, k, v, starts, lengths, 0.125)

