// Paged decode attention on CPU: one new query token per sequence, attending over its cached
// keys and values read in place from the paged cache (no gather into a scratch tensor).
//
// Shapes (float32):
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
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats; fixed so gcc vectorises

inline float dot(const float* a, const float* b, int64_t dim) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < dim; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) y[i] += alpha * x[i];
}

struct Rows {  // one sequence's query heads (read) or output heads (written)
  float* base;
  int64_t head_stride;
  float* head(int64_t row) const { return base + row * head_stride; }
};

void decode_one(Rows q, const float* key, const float* value, const int32_t* table,
                int64_t context_len, int64_t block_size, int64_t num_kv_heads,
                int64_t group, int64_t dim, float scale, Rows out,
                std::vector<float>& scores) {
  const int64_t token_stride = num_kv_heads * dim;  // floats between two offsets of a block
  const int64_t block_stride = block_size * token_stride;
  scores.resize(num_kv_heads * group * context_len);
  // scores[(h * G + g) * L + t] = q[h * G + g] . k[t, h] * scale
  for (int64_t t = 0; t < context_len; ++t) {
    const float* k_t = key + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        scores[row * context_len + t] = dot(q.head(row), k_t + h * dim, dim) * scale;
      }
    }
  }
  for (int64_t row = 0; row < num_kv_heads * group; ++row) {
    float* s = scores.data() + row * context_len;
    const float peak = *std::max_element(s, s + context_len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
    std::fill(out.head(row), out.head(row) + dim, 0.f);
  }
  for (int64_t t = 0; t < context_len; ++t) {
    const float* v_t = value + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        axpy(scores[row * context_len + t], v_t + h * dim, out.head(row), dim);
      }
    }
  }
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor rows,
                            torch::Tensor key, torch::Tensor value, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention takes float32 tensors");
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
  const int64_t num_rows = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key.size(1), num_kv_heads = key.size(2);
  TORCH_CHECK(key.size(3) == dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t num_seqs = rows.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs,
              "one block table and one context length per sequence");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    TORCH_CHECK(row_ids[n] >= 0 && row_ids[n] < num_rows, "a row index is outside the step");
  }
  float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t row = row_ids[n];
      decode_one(Rows{q + row * query.stride(0), query.stride(1)}, k, v,
                 tables + n * max_blocks, lens[n], block_size, num_kv_heads, group, dim,
                 static_cast<float>(scale), Rows{o + row * out.stride(0), out.stride(1)},
                 scores);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache, read in place (float32)");
}
