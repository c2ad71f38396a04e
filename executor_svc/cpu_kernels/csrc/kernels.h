// The kernels' entry points, shared by their sources and bindings.cpp.
#pragma once

#include <torch/extension.h>

// paged_decode.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor rows,
                            torch::Tensor key, torch::Tensor value, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale);

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);

// prefill_attention.cpp
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       torch::Tensor starts, torch::Tensor lengths, double scale);

// layer_stack.cpp
torch::Tensor layer_stack(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                          std::vector<torch::Tensor> weights, torch::Tensor kv, torch::Tensor slots,
                          torch::Tensor rows, torch::Tensor block_tables,
                          torch::Tensor context_lens, torch::Tensor fresh_starts,
                          torch::Tensor fresh_lengths, int64_t num_heads, double eps, double scale,
                          bool onednn, int64_t mkl_min_rows, int64_t mkl_max_rows);

bool onednn_linear_ops_available();

// small_gemm.cpp: linear layers of 1 to kSmallRowsMax rows on the plain weights.
constexpr int64_t kSmallRowsMax = 4;
// What follows the product (the module's EPILOGUE_NONE, _SILU and _TIMES).
enum SmallRowsEpilogue : int64_t { kNone = 0, kSilu = 1, kTimes = 2 };
torch::Tensor small_rows_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                const std::optional<torch::Tensor>& bias, int64_t epilogue,
                                const std::optional<torch::Tensor>& other);

// sampling.cpp
std::vector<torch::Tensor> argmax_logsumexp(torch::Tensor logits);

// packed_gemm.cpp
bool mkl_packed_gemm_available();
torch::Tensor mkl_pack_weight(torch::Tensor weight);
torch::Tensor mkl_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features);
