// Elementwise steps of a Llama-family decoder layer fused into one pass each over their rows,
// so that a layer runs one op where transformers' modules run five to seven (each op a full
// pass over [T, H] and, at one row, tens of microseconds of dispatch).
//
//   rms_norm(x [T, H], weight [H], eps) -> [T, H]
//       weight * (x * rsqrt(mean(x^2) + eps)), the statistics in float32 (as LlamaRMSNorm:
//       the normalised row is cast back to x's dtype before the weight multiplies it)
//   silu_mul(gate [T, I], up [T, I]) -> [T, I]
//       silu(gate) * up (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x))
//   rotary_(q [T, Hq, D], k [T, Hkv, D], cos [T, D], sin [T, D])
//       rotates q and k in place: x * cos + rotate_half(x) * sin, rotate_half(x) being
//       (-x[D/2:], x[:D/2]) (apply_rotary_pos_emb's formula); each token's heads contiguous,
//       tokens at any stride (q and k may be views of one fused q/k/v projection)
//
// Each takes float32 or bfloat16. In bfloat16 they round where transformers' modules round:
// each torch op on bf16 tensors computes in float32 and rounds its result to bf16, so silu_mul
// rounds silu(gate) before the product and rotary_ both products before their sum (rms_norm,
// the normalised row before the weight). bf16 is handled as its bits (widened by a shift,
// rounded to nearest even), which gcc vectorises; c10::BFloat16's conversions it did not.
// Rows may be strided (a view of a wider tensor) but each row is unit-strided. Rows are split
// across torch's threads.
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using simd::narrow;
using simd::rounded;
using simd::widen;

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
        const float v = widen(row[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) +
                                        static_cast<float>(eps));
      scalar_t* dst = op + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        narrow(widen(wp[i]) * rounded(widen(row[i]) * inv, scalar_t()), dst + i);
      }
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const torch::Tensor& gate, const torch::Tensor& up, torch::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const scalar_t* gp = gate.data_ptr<scalar_t>();
  const scalar_t* up_p = up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, rows, kMulRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gp + r * g_stride;
      const scalar_t* u = up_p + r * u_stride;
      scalar_t* dst = op + r * o_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float x = widen(g[i]);
        narrow(rounded(x / (1.f + std::exp(-x)), scalar_t()) * widen(u[i]), dst + i);
      }
    }
  });
}

template <typename scalar_t>
inline void rotate_heads(scalar_t* x, int64_t num_heads, int64_t dim, const scalar_t* cos,
                         const scalar_t* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < num_heads; ++h, x += dim) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = widen(x[i]), x2 = widen(x[i + half]);
      const scalar_t tag{};
      narrow(rounded(x1 * widen(cos[i]), tag) - rounded(x2 * widen(sin[i]), tag), x + i);
      narrow(rounded(x2 * widen(cos[i + half]), tag) + rounded(x1 * widen(sin[i + half]), tag),
             x + i + half);
    }
  }
}

template <typename scalar_t>
void rotary_rows(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
                 const torch::Tensor& sin) {
  const int64_t tokens = q.size(0), dim = q.size(2);
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
  scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, kNormRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads(qp + t * q_stride, q_heads, dim, cp + t * dim, sp + t * dim);
      rotate_heads(kp + t * k_stride, k_heads, dim, cp + t * dim, sp + t * dim);
    }
  });
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
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "gate and up share one dtype");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up share one shape");
  auto out = torch::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate, up, out);
  } else {
    silu_mul_rows<c10::BFloat16>(gate, up, out);
  }
  return out;
}

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "rotary_ takes float32 or bfloat16 tensors");
  for (const auto* t : {&q, &k, &cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == dtype, "rotary_ takes tensors of one dtype");
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "q [T, Hq, D], k [T, Hkv, D], cos and sin [T, D]");
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q and k must have each token's heads contiguous");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && cos.size(0) == tokens && k.size(2) == dim &&
                  cos.size(1) == dim && dim % 2 == 0,
              "q, k, cos and sin disagree on tokens or an even head_dim");
  if (dtype == at::kFloat) {
    rotary_rows<float>(q, k, cos, sin);
  } else {
    rotary_rows<c10::BFloat16>(q, k, cos, sin);
  }
}
