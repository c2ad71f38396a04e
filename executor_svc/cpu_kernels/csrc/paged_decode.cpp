// Paged decode attention on CPU: one new query token per sequence, attending over its cached
// keys and values read in place from the paged cache (no gather into a scratch tensor).
//
// Shapes (float32, or bfloat16 with float32 arithmetic):
//   query, out      [T, Hq, D]          the step's packed rows, any strides but a unit one on D
//                                       (the model hands query over as a transposed view)
//   rows            [N]                 int64: the decoding sequences' rows in query and out
//   key, value      [NB, S, Hkv, D]     one layer's cache, contiguous: block, offset, head, dim
//   block_tables    [N, max_blocks]     int32 block ids, padded past each context
//   context_lens    [N]                 int32 tokens to attend over (the new one included)
//
// Grouped-query attention: query head h*G + g reads KV head h (G = Hq / Hkv). Each sequence
// is one task (at::parallel_for, torch's own thread count): its blocks are read once, all
// KV heads together, so a block's memory is walked front to back.
//
// Head dims 64 and 128 (most models) take a path compiled for their size: each K or V head
// row is widened to float32 once, into registers, for all the query heads of its group (a
// bfloat16 row used to be widened element by element, once per query head).
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using simd::kLanes;
using simd::f32v;

// Token rows ahead: far enough to hide a DRAM access (4 rows measured ~4% slower in bf16).
constexpr int64_t kPrefetchAhead = 16;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}

template <typename key_t>
inline float dot(const float* a, const key_t* b, int64_t dim) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * static_cast<float>(b[i + j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < dim; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

template <typename value_t>
inline void axpy(float alpha, const value_t* x, float* y, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

template <typename scalar_t>
struct Rows {  // one sequence's query heads (read) or output heads (written)
  scalar_t* base;
  int64_t head_stride;
  scalar_t* head(int64_t row) const { return base + row * head_stride; }
};

struct Scratch {  // per task: reused across its sequences
  std::vector<float> scores;  // [Hq, L]
  std::vector<float> query;   // [Hq, D] in float32
  std::vector<float> out;     // [Hq, D] accumulated in float32
};

inline void softmax_rows(float* scores, int64_t rows, int64_t length) {
  for (int64_t row = 0; row < rows; ++row) {
    float* s = scores + row * length;
    const float peak = *std::max_element(s, s + length);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < length; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < length; ++t) s[t] *= inv;
  }
}

template <typename scalar_t>
void decode_one(Rows<scalar_t> q, const scalar_t* key, const scalar_t* value,
                const int32_t* table, int64_t context_len, int64_t block_size,
                int64_t num_kv_heads, int64_t group, int64_t dim, float scale,
                Rows<scalar_t> out, Scratch& scratch) {
  const int64_t num_heads = num_kv_heads * group;
  const int64_t token_stride = num_kv_heads * dim;  // elements between two offsets of a block
  const int64_t block_stride = block_size * token_stride;
  std::vector<float>& scores = scratch.scores;
  scores.resize(num_heads * context_len);
  scratch.query.resize(num_heads * dim);
  scratch.out.assign(num_heads * dim, 0.f);
  for (int64_t row = 0; row < num_heads; ++row) {
    std::copy(q.head(row), q.head(row) + dim, scratch.query.data() + row * dim);
  }
  // scores[(h * G + g) * L + t] = q[h * G + g] . k[t, h] * scale
  for (int64_t t = 0; t < context_len; ++t) {
    const scalar_t* k_t =
        key + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    if (t + kPrefetchAhead < context_len) {  // the next block starts anywhere: fetch it early
      const int64_t ahead = t + kPrefetchAhead;
      prefetch_row(key + table[ahead / block_size] * block_stride +
                       (ahead % block_size) * token_stride,
                   token_stride);
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        scores[row * context_len + t] =
            dot(scratch.query.data() + row * dim, k_t + h * dim, dim) * scale;
      }
    }
  }
  softmax_rows(scores.data(), num_heads, context_len);
  for (int64_t t = 0; t < context_len; ++t) {
    const scalar_t* v_t =
        value + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    if (t + kPrefetchAhead < context_len) {
      const int64_t ahead = t + kPrefetchAhead;
      prefetch_row(value + table[ahead / block_size] * block_stride +
                       (ahead % block_size) * token_stride,
                   token_stride);
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        axpy(scores[row * context_len + t], v_t + h * dim, scratch.out.data() + row * dim, dim);
      }
    }
  }
  for (int64_t row = 0; row < num_heads; ++row) {
    const float* acc = scratch.out.data() + row * dim;
    std::transform(acc, acc + dim, out.head(row), [](float x) { return scalar_t(x); });
  }
}

// decode_one for a head dim known at compile time (a multiple of kLanes): a head row is
// kDim / kLanes vectors, held in registers while every query head of its group uses it.
template <typename scalar_t, int kDim>
void decode_one_fixed(Rows<scalar_t> q, const scalar_t* key, const scalar_t* value,
                      const int32_t* table, int64_t context_len, int64_t block_size,
                      int64_t num_kv_heads, int64_t group, float scale, Rows<scalar_t> out,
                      Scratch& scratch) {
  constexpr int kChunks = kDim / kLanes;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t token_stride = num_kv_heads * kDim;
  const int64_t block_stride = block_size * token_stride;
  auto row_at = [&](const scalar_t* cache, int64_t t) {
    return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
  };
  std::vector<float>& scores = scratch.scores;
  scores.resize(num_heads * context_len);
  scratch.query.resize(num_heads * kDim);
  scratch.out.assign(num_heads * kDim, 0.f);
  float* query = scratch.query.data();
  float* acc = scratch.out.data();
  for (int64_t row = 0; row < num_heads; ++row) {  // widened and scaled once per sequence
    for (int c = 0; c < kChunks; ++c) {
      simd::store(query + row * kDim + c * kLanes, simd::load(q.head(row) + c * kLanes) * scale);
    }
  }
  for (int64_t t = 0; t < context_len; ++t) {
    if (t + kPrefetchAhead < context_len) prefetch_row(row_at(key, t + kPrefetchAhead), token_stride);
    const scalar_t* k_t = row_at(key, t);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      f32v k[kChunks];
      for (int c = 0; c < kChunks; ++c) k[c] = simd::load(k_t + h * kDim + c * kLanes);
      for (int64_t row = h * group; row < (h + 1) * group; ++row) {
        const float* q_row = query + row * kDim;
        f32v dot = k[0] * simd::load(q_row);
        for (int c = 1; c < kChunks; ++c) dot += k[c] * simd::load(q_row + c * kLanes);
        scores[row * context_len + t] = simd::sum(dot);
      }
    }
  }
  softmax_rows(scores.data(), num_heads, context_len);
  for (int64_t t = 0; t < context_len; ++t) {
    if (t + kPrefetchAhead < context_len) {
      prefetch_row(row_at(value, t + kPrefetchAhead), token_stride);
    }
    const scalar_t* v_t = row_at(value, t);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      f32v v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = simd::load(v_t + h * kDim + c * kLanes);
      for (int64_t row = h * group; row < (h + 1) * group; ++row) {
        const float p = scores[row * context_len + t];
        float* o = acc + row * kDim;
        for (int c = 0; c < kChunks; ++c) {
          simd::store(o + c * kLanes, simd::load(o + c * kLanes) + p * v[c]);
        }
      }
    }
  }
  for (int64_t row = 0; row < num_heads; ++row) {
    std::transform(acc + row * kDim, acc + (row + 1) * kDim, out.head(row),
                   [](float x) { return scalar_t(x); });
  }
}

template <typename scalar_t>
void run(torch::Tensor out, torch::Tensor query, torch::Tensor rows, torch::Tensor key,
         torch::Tensor value, torch::Tensor block_tables, torch::Tensor context_lens,
         double scale) {
  const int64_t num_heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key.size(1), num_kv_heads = key.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = rows.size(0), max_blocks = block_tables.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t row = row_ids[n];
      const Rows<scalar_t> q_rows{q + row * query.stride(0), query.stride(1)};
      const Rows<scalar_t> out_rows{o + row * out.stride(0), out.stride(1)};
      const int32_t* table = tables + n * max_blocks;
      const float s = static_cast<float>(scale);
      if (dim == 64) {
        decode_one_fixed<scalar_t, 64>(q_rows, k, v, table, lens[n], block_size, num_kv_heads,
                                       group, s, out_rows, scratch);
      } else if (dim == 128) {
        decode_one_fixed<scalar_t, 128>(q_rows, k, v, table, lens[n], block_size,
                                        num_kv_heads, group, s, out_rows, scratch);
      } else {
        decode_one<scalar_t>(q_rows, k, v, table, lens[n], block_size, num_kv_heads, group,
                             dim, s, out_rows, scratch);
      }
    }
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor rows,
                            torch::Tensor key, torch::Tensor value, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_decode_attention takes float32 or bfloat16 tensors");
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "query, out, key and value share one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "rows are int64, block_tables and context_lens int32");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && key.dim() == 4 &&
                  value.sizes() == key.sizes(),
              "query and out [T, Hq, D], key and value [NB, S, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be unit-strided");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && rows.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "the cache, rows, block tables and lengths are contiguous");
  TORCH_CHECK(key.size(3) == query.size(2) && query.size(1) % key.size(2) == 0,
              "head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == rows.size(0) && context_lens.size(0) == rows.size(0),
              "one block table and one context length per sequence");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows.size(0); ++n) {
    TORCH_CHECK(row_ids[n] >= 0 && row_ids[n] < query.size(0), "a row is outside the step");
  }
  if (dtype == at::kFloat) {
    run<float>(out, query, rows, key, value, block_tables, context_lens, scale);
  } else {
    run<c10::BFloat16>(out, query, rows, key, value, block_tables, context_lens, scale);
  }
}

