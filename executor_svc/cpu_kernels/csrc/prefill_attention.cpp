// Causal attention for prompts with no cached prefix, on CPU: each prompt's rows attend to its
// own rows up to themselves, over the step's packed rows (no padding to the longest prompt).
//
//   q, out          [T, Hq, D]   float32, or bfloat16 with float32 arithmetic; rows at any
//                                stride, each head's D unit-strided (q may be a view)
//   k, v            [T, Hkv, D]  the same rows' new keys and values
//   starts, lengths [P]          int64: each prompt's first row and its row count
//
// torch's CPU flash attention (SDPA) took 0.3 ms a layer for one 128-token prompt of SmolLM2
// (9 query heads, 3 KV heads, D 64) and 5.2 ms for 16 of them on an AMD EPYC, whatever the dtype:
// a fifth of a bf16 prefill step. Here a task is one block of kBlockRows query rows of one
// prompt and one KV head, with all the query heads of its group: each block of keys is widened
// to float32 (K transposed) once for all of its rows, and the scores of kLanes keys come out of
// one vector of FMAs per row. Online softmax (running max and sum per row), float32
// throughout; the output rounded once to the dtype. Tasks are handed out one at a time
// (OpenMP's dynamic schedule): causal blocks near a prompt's end cost more than its first.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using simd::f32v;
using simd::kLanes;

constexpr int64_t kBlockRows = 32;  // query rows a task takes, for each head of its group
constexpr int64_t kRowsAtOnce = 4;  // score rows computed together: one K load, four FMAs

struct Task {
  int64_t start, length, head, row0;  // the prompt, its KV head, the block's first row
};

template <int64_t D, typename scalar_t>
void attend_block(const Task& task, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, int64_t group, float scale) {
  constexpr int64_t kVecs = D / kLanes;
  const int64_t rows = std::min(kBlockRows, task.length - task.row0);
  const int64_t count = rows * group;  // score rows: head g's row i is g * rows + i
  const int64_t end = task.row0 + rows;  // keys [0, end) of the prompt
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(count * (2 * D + 2) + D * kLanes + kLanes * D));
  float* queries = buffer.data();          // [count, D], scaled
  float* acc = queries + count * D;        // [count, D]
  float* running_max = acc + count * D;    // [count]
  float* running_sum = running_max + count;
  float* keys_t = running_sum + count;     // [D, kLanes]: the key block, transposed
  float* values = keys_t + D * kLanes;     // [kLanes, D]
  const auto* qp = q.data_ptr<scalar_t>();
  const auto* kp = k.data_ptr<scalar_t>();
  const auto* vp = v.data_ptr<scalar_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      const scalar_t* src = qp + (task.start + task.row0 + i) * qs0 + (task.head * group + g) * qs1;
      float* dst = queries + (g * rows + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = simd::widen(src[d]) * scale;
    }
  }
  std::fill(acc, acc + count * D, 0.f);
  std::fill(running_max, running_max + count, -1e30f);  // finite: see below
  std::fill(running_sum, running_sum + count, 0.f);
  for (int64_t key0 = 0; key0 < end; key0 += kLanes) {
    const int64_t keys = std::min(kLanes, end - key0);
    for (int64_t j = 0; j < kLanes; ++j) {
      const bool real = j < keys;
      const scalar_t* krow = kp + (task.start + key0 + j) * ks0 + task.head * ks1;
      const scalar_t* vrow = vp + (task.start + key0 + j) * vs0 + task.head * vs1;
      for (int64_t d = 0; d < D; ++d) {
        keys_t[d * kLanes + j] = real ? simd::widen(krow[d]) : 0.f;
        values[j * D + d] = real ? simd::widen(vrow[d]) : 0.f;
      }
    }
    for (int64_t r0 = 0; r0 < count; r0 += kRowsAtOnce) {
      const int64_t batch = std::min(kRowsAtOnce, count - r0);
      f32v scores[kRowsAtOnce] = {};
      for (int64_t d = 0; d < D; ++d) {
        const f32v key = simd::load(keys_t + d * kLanes);
        for (int64_t b = 0; b < kRowsAtOnce; ++b) {
          if (b < batch) scores[b] += queries[(r0 + b) * D + d] * key;
        }
      }
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t r = r0 + b;
        const int64_t position = task.row0 + r % rows;  // the row's own key is its last
        const int64_t visible = std::min(keys, position - key0 + 1);
        if (visible <= 0) continue;
        alignas(64) float s[kLanes];
        simd::store(s, scores[b]);
        // Keys past the row's own: a finite stand-in for -inf (fast-math assumes no
        // infinities), whose exp is 0.
        for (int64_t j = visible; j < kLanes; ++j) s[j] = -1e30f;
        float block_max = s[0];
        for (int64_t j = 1; j < kLanes; ++j) block_max = std::max(block_max, s[j]);
        const float new_max = std::max(running_max[r], block_max);
        const float rescale = std::exp(running_max[r] - new_max);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < kLanes; ++j) {
          s[j] = std::exp(s[j] - new_max);
          sum += s[j];
        }
        running_max[r] = new_max;
        running_sum[r] = running_sum[r] * rescale + sum;
        float* a = acc + r * D;
        f32v o[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) o[c] = simd::load(a + c * kLanes) * rescale;
        for (int64_t j = 0; j < visible; ++j) {
          const float p = s[j];
          for (int64_t c = 0; c < kVecs; ++c) o[c] += p * simd::load(values + j * D + c * kLanes);
        }
        for (int64_t c = 0; c < kVecs; ++c) simd::store(a + c * kLanes, o[c]);
      }
    }
  }
  auto* op = out.data_ptr<scalar_t>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = g * rows + i;
      scalar_t* dst = op + (task.start + task.row0 + i) * os0 + (task.head * group + g) * os1;
      const float inverse = 1.f / running_sum[r];
      for (int64_t d = 0; d < D; ++d) simd::narrow(acc[r * D + d] * inverse, dst + d);
    }
  }
}

template <typename scalar_t>
void run_tasks(const std::vector<Task>& tasks, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& out, int64_t group, float scale) {
  const int64_t head_dim = q.size(2);
  const auto count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < count; ++t) {
    if (head_dim == 64) {
      attend_block<64, scalar_t>(tasks[t], q, k, v, out, group, scale);
    } else {
      attend_block<128, scalar_t>(tasks[t], q, k, v, out, group, scale);
    }
  }
}

}  // namespace

void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       torch::Tensor starts, torch::Tensor lengths, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "prefill_attention takes float32 or bfloat16 rows");
  for (const auto* t : {&out, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, v and out must share one dtype");
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "q and out must be [T, Hq, D], k and v [T, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "k and v must be [T, Hkv, D] for q's T and D");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "prefill_attention takes head dims 64 and 128");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "the query heads must be a multiple of the KV heads");
  for (const auto* t : {&out, &q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1, "each head's D must be unit-strided");
  }
  TORCH_CHECK(starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  starts.dim() == 1 && starts.sizes() == lengths.sizes() &&
                  starts.is_contiguous() && lengths.is_contiguous(),
              "starts and lengths must be [P] int64, contiguous");
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t kv_heads = k.size(1), group = q.size(1) / kv_heads;
  std::vector<Task> tasks;
  for (int64_t p = 0; p < starts.size(0); ++p) {
    TORCH_CHECK(length[p] >= 0 && first[p] >= 0 && first[p] + length[p] <= q.size(0),
                "a prompt's rows are outside q");
    // The last blocks (the dearest) first, so the dynamic schedule ends on cheap ones.
    for (int64_t row0 = (length[p] - 1) / kBlockRows * kBlockRows; row0 >= 0 && length[p] > 0;
         row0 -= kBlockRows) {
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({first[p], length[p], h, row0});
    }
  }
  const auto s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    run_tasks<float>(tasks, q, k, v, out, group, s);
  } else {
    run_tasks<c10::BFloat16>(tasks, q, k, v, out, group, s);
  }
}
