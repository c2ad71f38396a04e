"""How long a simulated step takes: a roofline-shaped cost model, calibrated on published
GPU figures, with a small table of profiles (`--simulate-profile`).

    step_ms = overhead_ms                                    launches, scheduling, sampling
            + max(weights_ms, ms_per_token x num_tokens)     linear layers: read the weights
                                                             once, or compute-bound past that
            + ms_per_context_token x num_context_tokens      attention: each K/V read once
            + num_swapped_blocks x block bytes / host link   swap_out + swap_in over PCIe

`num_tokens` counts every token the step computes (prefill chunks and decodes alike);
`num_context_tokens` sums, over its sequences, the positions each attends to
(start_position + its tokens). Copies (copy-on-write, a block on the device) are free.

Calibration (`llama2-7b-a100`): TensorRT-LLM's published performance page
(NVIDIA/TensorRT-LLM, docs/source/performance.md: the v0.6.1 "A100 GPUs (FP16)" throughput
table and the v0.5 "Low Latency" table), LLaMA 7B (Llama-2-7B), FP16, one A100-80GB SXM:

    static batch 384, 128 in -> 128 out        5,586 output tok/s
    static batch  60, 128 in -> 2,048 out      1,928 output tok/s
    static batch  52, 2,048 in -> 128 out        591 output tok/s
    batch 1, first-token latency, 128 in          16 ms
    batch 1, first-token latency, 2,048 in       133 ms

Each run replayed step by step (one prefill step of batch x input tokens, then output - 1
decode steps whose contexts grow by one token), a grid search for the least worst relative
error gave the constants below; all five points come out within 1.3%
(tests/executor/test_simulated_profiles.py pins them at 2%). For scale: 8.0 ms of weights is
13.5 GB at 83% of the A100's 2.04 TB/s; 0.060 ms a token is 2 x 6.7 GFLOP at 72% of its
312 TFLOP/s; 0.21 us a context token is below the 0.26 us that 512 KiB of K/V takes at peak
bandwidth, so read it as an empirical constant (the fit folds some attention into the other
terms). Batch-1 decode comes out at 16 ms, which the table does not measure (probably high).

The Llama-3-8B profiles are derived, not measured: each term scaled from the A100 fit by the
model's size and the GPU's datasheet peaks, carrying the A100 efficiencies over. Llama-3-8B:
8.03 B parameters (16.06 GB bf16), 32 layers x 8 KV heads x 128 dims: 128 KiB of K/V a token,
a quarter of Llama-2-7B's (grouped-query attention). H100 SXM: 3.35 TB/s, 989 TFLOP/s dense
bf16, PCIe 5 (64 GB/s); H200 SXM: 4.8 TB/s, the same compute. KV capacity: 90% of the GPU's
memory less the weights and 2 GB of activations; host blocks: vLLM's default 4 GiB swap.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class StepShape:
    num_tokens: int  # computed this step: prefill chunks and decodes
    num_context_tokens: int  # sum over sequences of start_position + their tokens
    num_swapped_blocks: int = 0  # swap_out + swap_in


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    bf16_flops: float  # dense
    host_link_bytes_s: float  # PCIe, one direction


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    num_params: float
    weight_bytes: float
    kv_bytes_per_token: int  # all layers, key and value
    dtype: str


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: Model
    gpu: Gpu
    overhead_ms: float
    weights_ms: float
    ms_per_token: float
    ms_per_context_token: float
    source: str  # "published" (fitted) or "derived" (scaled from a fit)

    @property
    def kv_capacity_tokens(self) -> int:
        free = 0.9 * self.gpu.memory_bytes - self.model.weight_bytes - 2 * GB
        return int(free // self.model.kv_bytes_per_token)

    def num_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens // block_size

    def num_cpu_blocks(self, block_size: int) -> int:
        return int(4 * 2**30 // (self.model.kv_bytes_per_token * block_size))

    def transfer_ms(self, num_blocks: int, block_size: int) -> float:
        """A KV hand-off's blocks between two executors' GPUs (ImportKV), over the link."""
        return 1e3 * num_blocks * block_size * self.model.kv_bytes_per_token / KV_LINK_BYTES_S

    def step_ms(self, shape: StepShape, block_size: int) -> float:
        if not shape.num_tokens and not shape.num_swapped_blocks:
            return 0.0  # releases and copies only: no forward pass
        swap_bytes = shape.num_swapped_blocks * block_size * self.model.kv_bytes_per_token
        forward = 0.0
        if shape.num_tokens:
            forward = (self.overhead_ms + max(self.weights_ms, self.ms_per_token * shape.num_tokens)
                       + self.ms_per_context_token * shape.num_context_tokens)
        return forward + 1e3 * swap_bytes / self.gpu.host_link_bytes_s


# KV moved between executors (hand-off): one 400 Gb/s RDMA NIC, as prefill and decode
# executors on different nodes would have; GPUs of one node (NVLink) are ~10x faster.
KV_LINK_BYTES_S = 50 * GB

A100 = Gpu("a100-sxm-80gb", 80 * GB, 2.039e12, 312e12, 32 * GB)
H100 = Gpu("h100-sxm-80gb", 80 * GB, 3.35e12, 989e12, 64 * GB)
H200 = Gpu("h200-sxm-141gb", 141 * GB, 4.8e12, 989e12, 64 * GB)
LLAMA2_7B = Model("llama2-7b", 6.74e9, 13.48 * GB, 32 * 2 * 32 * 128 * 2, "float16")
LLAMA3_8B = Model("llama3-8b", 8.03e9, 16.06 * GB, 32 * 2 * 8 * 128 * 2, "bfloat16")

# The fit on TensorRT-LLM's published A100 figures (module docstring).
LLAMA2_7B_A100 = Profile("llama2-7b-a100", LLAMA2_7B, A100, overhead_ms=8.0, weights_ms=8.0,
                         ms_per_token=0.060, ms_per_context_token=0.00021, source="published")


def scaled(fit: Profile, model: Model, gpu: Gpu) -> Profile:
    """`fit`'s efficiencies carried over to another model and GPU (datasheet ratios)."""
    bandwidth = fit.gpu.bandwidth_bytes_s / gpu.bandwidth_bytes_s
    return Profile(
        name=f"{model.name}-{gpu.name.split('-')[0]}",
        model=model,
        gpu=gpu,
        overhead_ms=fit.overhead_ms,
        weights_ms=fit.weights_ms * model.weight_bytes / fit.model.weight_bytes * bandwidth,
        ms_per_token=fit.ms_per_token * model.num_params / fit.model.num_params
        * fit.gpu.bf16_flops / gpu.bf16_flops,
        ms_per_context_token=fit.ms_per_context_token * model.kv_bytes_per_token
        / fit.model.kv_bytes_per_token * bandwidth,
        source="derived",
    )


PROFILES: dict[str, Profile] = {
    p.name: p for p in (
        LLAMA2_7B_A100,
        scaled(LLAMA2_7B_A100, LLAMA3_8B, H100),
        scaled(LLAMA2_7B_A100, LLAMA3_8B, H200),
    )
}
DEFAULT_PROFILE = "llama3-8b-h100"
