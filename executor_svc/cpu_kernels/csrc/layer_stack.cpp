// A step of decode rows and fresh prompts through every layer of a fused Llama-family decoder
// in one call.
//
// executor_svc/layer_loop.py runs a layer as ~25 Python-level calls (modules, views, ops).
// At a decode step's sizes their dispatch is a large share of the step: SmolLM2-135M's 30
// layers with their widths cut to 128 (so that the bytes cost nothing) took ~8 ms a
// one-sequence bfloat16 step, against ~25 ms for the real model. This makes the same ops in
// the same order from C++, so the hidden states are the same bits as the Python loop's:
//
//   x = rms_norm(h, in_norm); q, k, v = projections of x; rotary_(q, k); K/V written to their
//   slots; a = paged decode attention of the decode rows, then prefill_attention of the
//   prompts without a cached prefix (each over its own rows); h = h + a @ Wo^T;
//   x = rms_norm(h, post_norm); h = h + (silu(x @ Wgate^T) * (x @ Wup^T)) @ Wdown^T
//
// (A 128-token prompt's step takes 43 ms here against 46-49 through the Python loop, bf16 on
// an AMD EPYC; a chunk after a cached prefix keeps the Python loop.)
//
// Each layer's linears are packed as packed_linear.py packs them, and called as the Python
// loop calls them (`onednn` says which):
//   oneDNN (bfloat16; float32 off Intel CPUs): oneDNN-packed weights through torch's own
//     operator (mkldnn::_linear_pointwise), q/k/v as one matmul, the SiLU and the product in
//     the gate and up matmuls' epilogues; a step of 1 to kSmallRowsMax rows reads the plain
//     weights through small_rows_linear instead (small_gemm.cpp), with the same epilogues, as
//     OneDnnWeight does; 14 tensors a layer: in_norm, qkv, o, post_norm, gate, up, down
//     packed, then the plain q, k, v, o, gate, up, down;
//   MKL (float32 on Intel CPUs): MKL-packed copies for min_rows..max_rows rows and F.linear
//     otherwise (PackedLinear.forward), silu_mul between; 16 tensors a layer: in_norm, then
//     each of q, k, v, o as (weight, packed), post_norm, then gate, up, down as (weight,
//     packed).
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kOneDnnWeightsPerLayer = 14;
constexpr int64_t kMklWeightsPerLayer = 16;

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           c10::string_view, c10::List<std::optional<at::Scalar>>,
                           std::optional<c10::string_view>);
using LinearTimesFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, c10::string_view);
using LinearOp = c10::TypedOperatorHandle<LinearFn>;
using LinearTimesOp = c10::TypedOperatorHandle<LinearTimesFn>;

// torch's oneDNN linear operators, by the signatures this file calls them with: looked up once
// (a torch whose signatures differ throws here, which onednn_linear_ops_available() reports).
const LinearOp& linear_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<LinearFn>();
  return op;
}

const LinearTimesOp& linear_times_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                             .typed<LinearTimesFn>();
  return op;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, c10::string_view attr) {
  return linear_op().call(x, packed, std::nullopt, attr, c10::List<std::optional<at::Scalar>>(),
                          c10::string_view(""));
}

// (x @ W^T) * other, the product taken in float32 before it is rounded.
at::Tensor linear_times(const at::Tensor& x, const at::Tensor& other, const at::Tensor& packed) {
  return linear_times_op().call(x, other, packed, std::nullopt, "mul");
}

at::Tensor small(const at::Tensor& x, const std::vector<torch::Tensor>& weights,
                 SmallRowsEpilogue epilogue = kNone,
                 const std::optional<at::Tensor>& other = std::nullopt) {
  return small_rows_linear(x, weights, std::nullopt, epilogue, other);
}

// K and V rows [T, Hkv * D] (rows at any stride, each unit-strided) into their slots of one
// layer's cache [2, num_blocks, block_size, Hkv, D], as index_copy_ would.
void write_kv(const at::Tensor& layer_kv, const at::Tensor& k, const at::Tensor& v,
              const int64_t* slots, int64_t num_slots) {
  const int64_t tokens = k.size(0), row = k.size(1);
  const size_t bytes = static_cast<size_t>(row) * k.element_size();
  char* key_base = static_cast<char*>(layer_kv.data_ptr());
  char* value_base = key_base + num_slots * static_cast<int64_t>(bytes);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size();
  const int64_t v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(key_base + slots[t] * bytes, kp + t * k_stride, bytes);
    std::memcpy(value_base + slots[t] * bytes, vp + t * v_stride, bytes);
  }
}

// F.linear, or MKL's packed copy for the rows PackedLinear gives it.
struct MklLinears {
  int64_t min_rows, max_rows;

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& packed) const {
    const int64_t rows = x.size(0);
    if (rows >= min_rows && rows <= max_rows) {
      return mkl_packed_linear(x, packed, weight.size(0));
    }
    return at::linear(x, weight);
  }
};

struct Shape {
  int64_t tokens, num_heads, num_kv_heads, head_dim, num_slots;
  double scale;
};

// A step's attention plan: its decode rows (`rows`, possibly none) read the paged cache; its
// fresh prompts (`fresh_starts`/`fresh_lengths`, possibly none) attend over their own rows.
struct Plan {
  const int64_t* slots;
  const at::Tensor& rows;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  const at::Tensor& fresh_starts;
  const at::Tensor& fresh_lengths;
};

// Writes the step's K/V into `layer_kv`, then returns the attention's output [T, Hq * D]:
// TorchStepAttention.forward's order (K/V written, decode rows, then fresh prompts).
at::Tensor attend(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& layer_kv,
                  const Plan& plan) {
  TORCH_CHECK(q.size(1) == s.num_heads * s.head_dim && k.size(1) == s.num_kv_heads * s.head_dim &&
                  v.sizes() == k.sizes(),
              "a layer's q, k and v widths disagree with num_heads and the cache's heads");
  auto q_heads = q.view({s.tokens, s.num_heads, s.head_dim});
  auto k_heads = k.view({s.tokens, s.num_kv_heads, s.head_dim});
  rotary_(q_heads, k_heads, cos, sin);
  write_kv(layer_kv, k, v, plan.slots, s.num_slots);
  auto out = torch::empty({s.tokens, s.num_heads, s.head_dim}, q.options());
  if (plan.rows.numel() > 0) {
    paged_decode_attention(out, q_heads, plan.rows, layer_kv[0], layer_kv[1], plan.block_tables,
                           plan.context_lens, s.scale);
  }
  if (plan.fresh_starts.numel() > 0) {
    prefill_attention(out, q_heads, k_heads, v.view({s.tokens, s.num_kv_heads, s.head_dim}),
                      plan.fresh_starts, plan.fresh_lengths, s.scale);
  }
  return out.view({s.tokens, s.num_heads * s.head_dim});
}

}  // namespace

bool onednn_linear_ops_available() {
  try {
    linear_op();
    linear_times_op();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

torch::Tensor layer_stack(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                          std::vector<torch::Tensor> weights, torch::Tensor kv, torch::Tensor slots,
                          torch::Tensor rows, torch::Tensor block_tables,
                          torch::Tensor context_lens, torch::Tensor fresh_starts,
                          torch::Tensor fresh_lengths, int64_t num_heads, double eps, double scale,
                          bool onednn, int64_t mkl_min_rows, int64_t mkl_max_rows) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || (dtype == at::kBFloat16 && onednn),
              "hidden must be bfloat16 (oneDNN-packed layers) or float32 (oneDNN- or MKL-packed)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be [T, H], contiguous");
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.is_contiguous() && kv.scalar_type() == dtype,
              "the cache must be [L, 2, NB, S, Hkv, D], contiguous, of hidden's dtype");
  const int64_t layers = kv.size(0);
  const int64_t per_layer = onednn ? kOneDnnWeightsPerLayer : kMklWeightsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * layers, "layer_stack takes ",
              per_layer, " weights for each of the cache's ", layers, " layers, got ",
              weights.size());
  const Shape shape{hidden.size(0), num_heads, kv.size(4), kv.size(5), kv.size(2) * kv.size(3),
                    scale};
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == shape.tokens,
              "slots must be [T] int64, one per token");
  const int64_t* slot_ids = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < shape.tokens; ++t) {
    TORCH_CHECK(slot_ids[t] >= 0 && slot_ids[t] < shape.num_slots, "a slot is outside the cache");
  }
  const int64_t q_width = num_heads * shape.head_dim;
  const int64_t kv_width = shape.num_kv_heads * shape.head_dim;
  const MklLinears mkl{mkl_min_rows, mkl_max_rows};
  const bool few_rows = shape.tokens <= kSmallRowsMax;
  const Plan plan{slot_ids, rows, block_tables, context_lens, fresh_starts, fresh_lengths};
  for (int64_t layer = 0; layer < layers; ++layer) {
    const torch::Tensor* w = weights.data() + layer * per_layer;
    const auto layer_kv = kv[layer];
    auto x = rms_norm(hidden, w[0], eps);
    if (onednn) {
      // [T, q_width + 2 * kv_width]
      auto qkv = few_rows ? small(x, {w[7], w[8], w[9]}) : linear(x, w[1], "none");
      TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "the q/k/v weight's width is not ",
                  q_width + 2 * kv_width);
      auto attended = attend(shape, qkv.narrow(1, 0, q_width), qkv.narrow(1, q_width, kv_width),
                             qkv.narrow(1, q_width + kv_width, kv_width), cos, sin, layer_kv,
                             plan);
      if (few_rows) {
        hidden = hidden + small(attended, {w[10]});
        x = rms_norm(hidden, w[3], eps);
        auto gate = small(x, {w[11]}, kSilu);
        hidden = hidden + small(small(x, {w[12]}, kTimes, gate), {w[13]});
      } else {
        hidden = hidden + linear(attended, w[2], "none");
        x = rms_norm(hidden, w[3], eps);
        hidden = hidden + linear(linear_times(x, linear(x, w[4], "swish"), w[5]), w[6], "none");
      }
    } else {
      auto attended = attend(shape, mkl(x, w[1], w[2]), mkl(x, w[3], w[4]), mkl(x, w[5], w[6]),
                             cos, sin, layer_kv, plan);
      hidden = hidden + mkl(attended, w[7], w[8]);
      x = rms_norm(hidden, w[9], eps);
      hidden = hidden + mkl(silu_mul(mkl(x, w[10], w[11]), mkl(x, w[12], w[13])), w[14], w[15]);
    }
  }
  return hidden;
}
