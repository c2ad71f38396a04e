// Elementwise steps of a Llama-family decoder layer fused into one pass each over their rows,
// so that a layer runs one op where transformers' modules run five to seven (each op a full
// pass over [T, H] and, at one row, tens of microseconds of dispatch).
//
//   rms_norm(x [T, H], weight [H], eps) -> [T, H]
//       weight * (x * rsqrt(mean(x^2) + eps)), the statistics in float32 (as LlamaRMSNorm:
//       the normalised row is cast back to x's dtype before the weight multiplies it)
//   silu_mul(gate [T, I], up [T, I]) -> [T, I]
//       silu(gate) * up (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)); float32 only: in
//       bfloat16 gcc does not vectorise the conversions and torch's two ops were 3-5x faster
//   rotary_(q [T, Hq, D], k [T, Hkv, D], cos [T, D], sin [T, D])
//       rotates q and k in place: x * cos + rotate_half(x) * sin, rotate_half(x) being
//       (-x[D/2:], x[:D/2]) (apply_rotary_pos_emb's formula); float32, contiguous
//
// rms_norm takes float32 or bfloat16; rows may be strided (a view of a wider tensor) but each row is
// unit-strided. Rows are split across torch's threads.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

// Rows per task: below this many rows one thread does all of them (a hidden row is ~0.3 us).
constexpr int64_t kNormRowsPerTask = 16;
constexpr int64_t kMulRowsPerTask = 4;  // intermediate rows are wider

template <typename scalar_t>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                   torch::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kNormRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = xp + r * x_stride;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) {
        const float v = static_cast<float>(row[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) +
                                        static_cast<float>(eps));
      scalar_t* dst = op + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(row[i]) * inv);
        dst[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

void silu_mul_rows(const torch::Tensor& gate, const torch::Tensor& up, torch::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const float* gp = gate.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, rows, kMulRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * g_stride;
      const float* u = up_p + r * u_stride;
      float* dst = op + r * o_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) dst[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

inline void rotate_heads(float* x, int64_t num_heads, int64_t dim, const float* cos,
                         const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < num_heads; ++h, x += dim) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * cos[i] - x2 * sin[i];
      x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width], unit-strided rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [width], contiguous, of x's dtype");
  auto out = torch::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, eps, out);
  } else {
    rms_norm_rows<c10::BFloat16>(x, weight, eps, out);
  }
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat,
              "silu_mul takes float32");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up share one shape");
  auto out = torch::empty(gate.sizes(), gate.options());
  silu_mul_rows(gate, up, out);
  return out;
}

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (const auto* t : {&q, &k, &cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "rotary_ takes contiguous float32 tensors");
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "q [T, Hq, D], k [T, Hkv, D], cos and sin [T, D]");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && cos.size(0) == tokens && k.size(2) == dim &&
                  cos.size(1) == dim && dim % 2 == 0,
              "q, k, cos and sin disagree on tokens or an even head_dim");
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, kNormRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads(qp + t * q_heads * dim, q_heads, dim, cp + t * dim, sp + t * dim);
      rotate_heads(kp + t * k_heads * dim, k_heads, dim, cp + t * dim, sp + t * dim);
    }
  });
}
