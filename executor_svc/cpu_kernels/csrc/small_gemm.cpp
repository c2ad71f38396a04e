// Linear layers for a few rows (a decode step of a few sequences) on the plain weights.
//
//   small_rows_linear(x [M, K], weights {[N_i, K]}, bias [sum N_i] or None, epilogue,
//                     other [M, sum N_i] or None) -> [M, sum N_i]
//       x @ (the weights side by side)^T + bias, then the epilogue: 0 none, 1 SiLU, 2 times
//       `other`; each product summed in float32 and rounded once to x's dtype (float32 or
//       bfloat16), as oneDNN's epilogues round.
//
// At one to four rows a linear layer is a matter of reading its weight, and oneDNN's packed
// `_linear_pointwise` spends ~20 us a call besides that. This reads each weight row once for
// all M rows, in one parallel region a call, prefetching one block of rows ahead: SmolLM2's 210
// layer weights in 0.70-0.75x oneDNN's time in bf16 and 0.85x in float32 at one row on an AMD
// EPYC (bench/README.md, "A few rows on the plain weights").
//
// Each output is one thread's dot product in a fixed order, so the bits do not depend on the
// thread count or on which weights are side by side (q/k/v as one call or three).
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using simd::f32v;
using simd::kLanes;

// Weight rows a task reads side by side: with M input rows, kRowsPerBlock * M accumulators.
constexpr int64_t kRowsPerBlock = 4;

template <typename T>
struct Output {
  T* out;
  int64_t ld;  // out's and other's row stride
  const T* bias;
  const T* other;
  SmallRowsEpilogue epilogue;

  void store(int64_t m, int64_t n, float sum) const {
    float v = sum + (bias ? simd::widen(bias[n]) : 0.f);
    if (epilogue == kSilu) {
      v = v / (1.f + std::exp(-v));
    } else if (epilogue == kTimes) {
      v *= simd::widen(other[m * ld + n]);
    }
    simd::narrow(v, out + m * ld + n);
  }
};

// R output columns from n0 (weight rows w[n0..n0 + R)), for M input rows x already widened to
// float32 [M, K]; written at `column + n0`. R and M are constants, so the R * M accumulators
// stay in registers. `ahead`: the rows to prefetch as these are read (the next block's, or
// these again at the weight's end).
template <typename T, int M, int R>
void dot_rows(const float* x, const T* w, const T* ahead, int64_t K, int64_t n0, int64_t column,
              const Output<T>& o) {
  const int64_t vec_end = K - K % kLanes;
  f32v acc[R][M] = {};
  for (int64_t k = 0; k < vec_end; k += kLanes) {
    f32v xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(ahead + r * K + k);  // as far along
      const f32v wv = simd::load(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float sum = simd::sum(acc[r][m]);
      for (int64_t k = vec_end; k < K; ++k) sum += simd::widen(w[(n0 + r) * K + k]) * x[m * K + k];
      o.store(m, column + n0 + r, sum);
    }
  }
}

// Output columns [n_begin, n_end) of one weight of N rows: kRowsPerBlock at a time, each
// block prefetching the next (within the weight), then one at a time.
template <typename T, int M>
void dot_block(const float* x, const T* w, int64_t N, int64_t K, int64_t n_begin,
               int64_t n_end, int64_t column, const Output<T>& o) {
  int64_t n = n_begin;
  for (; n + kRowsPerBlock <= n_end; n += kRowsPerBlock) {
    const int64_t next = n + 2 * kRowsPerBlock <= N ? n + kRowsPerBlock : n;
    dot_rows<T, M, kRowsPerBlock>(x, w, w + next * K, K, n, column, o);
  }
  for (; n < n_end; ++n) dot_rows<T, M, 1>(x, w, w + n * K, K, n, column, o);
}

template <typename T, int M>
void linear_rows(const float* x, const std::vector<torch::Tensor>& weights, int64_t K,
                 const Output<T>& o) {
#pragma omp parallel num_threads(at::get_num_threads())  // torch's count, as the others
  {
    int64_t column = 0;
    for (const auto& weight : weights) {
      const T* w = weight.data_ptr<T>();
      const int64_t N = weight.size(0);
      const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = b * kRowsPerBlock;
        dot_block<T, M>(x, w, N, K, n, std::min(N, n + kRowsPerBlock), column, o);
      }
      column += N;
    }
  }
}

template <typename T>
void dispatch(const float* x, int64_t M, const std::vector<torch::Tensor>& weights, int64_t K,
              const Output<T>& o) {
  switch (M) {
    case 1: return linear_rows<T, 1>(x, weights, K, o);
    case 2: return linear_rows<T, 2>(x, weights, K, o);
    case 3: return linear_rows<T, 3>(x, weights, K, o);
    case 4: return linear_rows<T, 4>(x, weights, K, o);
    default: TORCH_CHECK(false, "small_rows_linear takes 1 to ", kSmallRowsMax, " rows, got ", M);
  }
}

}  // namespace

torch::Tensor small_rows_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                const std::optional<torch::Tensor>& bias, int64_t epilogue,
                                const std::optional<torch::Tensor>& other) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], each row unit-strided");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kSmallRowsMax, "small_rows_linear takes 1 to ", kSmallRowsMax,
              " rows, got ", M);
  TORCH_CHECK(!weights.empty(), "small_rows_linear needs a weight");
  int64_t width = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && w.scalar_type() == dtype,
                "each weight must be [N, K] of x's K and dtype, contiguous");
    width += w.size(0);
  }
  TORCH_CHECK(epilogue >= kNone && epilogue <= kTimes, "the epilogue must be 0 (none), 1 (SiLU) "
              "or 2 (times other)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == width && bias->is_contiguous() &&
                        bias->scalar_type() == dtype),
              "the bias must be [sum N], contiguous, of x's dtype");
  const bool times = epilogue == kTimes;
  TORCH_CHECK(times == (other.has_value() && other->defined()),
              "`other` goes with the times epilogue, and only with it");
  TORCH_CHECK(!times || (other->dim() == 2 && other->size(0) == M && other->size(1) == width &&
                         other->is_contiguous() && other->scalar_type() == dtype),
              "`other` must be [M, sum N], contiguous, of x's dtype");
  // x widened once: every weight row multiplies it.
  const auto wide = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, width}, x.options());
  const bool has_bias = bias.has_value() && bias->defined();
  if (dtype == at::kFloat) {
    const Output<float> o{out.data_ptr<float>(), width,
                          has_bias ? bias->data_ptr<float>() : nullptr,
                          times ? other->data_ptr<float>() : nullptr,
                          static_cast<SmallRowsEpilogue>(epilogue)};
    dispatch<float>(wide.data_ptr<float>(), M, weights, K, o);
  } else {
    using bf16 = c10::BFloat16;
    const Output<bf16> o{out.data_ptr<bf16>(), width,
                         has_bias ? bias->data_ptr<bf16>() : nullptr,
                         times ? other->data_ptr<bf16>() : nullptr,
                         static_cast<SmallRowsEpilogue>(epilogue)};
    dispatch<bf16>(wide.data_ptr<float>(), M, weights, K, o);
  }
  return out;
}
