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
// Grouped-query attention: query head h*G + g reads KV head h (G = Hq / Hkv). A task (one
// at::parallel_for index, torch's own thread count) is a whole sequence, all its KV heads, so
// each token's K/V row is read in one piece; with fewer than two sequences per thread, one KV
// head of a sequence, so that a lone sequence still spreads over the threads. Each K or V head
// row is read once, for all the query heads of its group.
//
// Head dims 64 and 128 (most models) take a path compiled for their size: a K or V head row
// is widened to float32 once, into registers, and the scores of kLanes tokens are reduced
// together (simd::sum_each), not one horizontal sum per token and query head.
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using simd::kLanes;
using simd::f32v;

// Sequences per thread from which a task is a whole sequence, not one of its KV heads (one
// bf16 sequence's attention took 0.68-0.81x the time split by head; four, in tasks of one
// head against whole sequences, fp32 took ~10% more: bench/README.md).
constexpr int64_t kWholeRowSeqsPerThread = 2;

// Token rows ahead: far enough to hide a DRAM access (4 rows measured ~4% slower in bf16).
constexpr int64_t kPrefetchAhead = 16;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}

// One sequence's rows of one layer's cache, from a task's first KV head: token t's K row is
// key + offsets[t], its V row value + offsets[t] (K and V share a layout). The offsets are worked out
// once per task, block by block: a division per token read cost more than the reads.
template <typename scalar_t>
struct HeadRows {
  const scalar_t* key;    // the cache's first block, offset to the head
  const scalar_t* value;
  const int64_t* offsets;  // [L]

  const scalar_t* k(int64_t t) const { return key + offsets[t]; }
  const scalar_t* v(int64_t t) const { return value + offsets[t]; }
};

inline const int64_t* token_offsets(const int32_t* table, int64_t context_len,
                                    int64_t block_size, int64_t token_stride,
                                    std::vector<int64_t>& offsets) {
  offsets.resize(context_len);
  const int64_t block_stride = block_size * token_stride;
  for (int64_t start = 0, b = 0; start < context_len; start += block_size, ++b) {
    const int64_t base = table[b] * block_stride;
    const int64_t end = std::min(context_len, start + block_size);
    for (int64_t t = start; t < end; ++t) offsets[t] = base + (t - start) * token_stride;
  }
  return offsets.data();
}

template <typename scalar_t>
struct Rows {  // one sequence's group of query heads (read) or output heads (written)
  scalar_t* base;
  int64_t head_stride;
  scalar_t* head(int64_t row) const { return base + row * head_stride; }
};

struct Scratch {  // per thread: reused across its tasks
  std::vector<float> scores;  // [rows, L], rows = the task's query heads (heads * G)
  std::vector<float> query;   // [rows, D] in float32, scaled
  std::vector<float> out;     // [rows, D] accumulated in float32
  std::vector<int64_t> offsets;  // [L] each token's row in the cache
  struct Products { f32v of[kLanes]; };  // one query head's products with kLanes tokens
  std::vector<Products> products;  // [rows]
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
void widen_query(Rows<scalar_t> q, int64_t group, int64_t dim, float scale, float* query) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < dim; ++i) query[g * dim + i] = simd::widen(q.head(g)[i]) * scale;
  }
}

template <typename scalar_t>
void write_out(const float* acc, int64_t group, int64_t dim, Rows<scalar_t> out) {
  for (int64_t g = 0; g < group; ++g) {
    std::transform(acc + g * dim, acc + (g + 1) * dim, out.head(g),
                   [](float x) { return scalar_t(x); });
  }
}

// One task: `heads` adjacent KV heads of one sequence, each with its group of G query heads
// (rows = heads * G query rows; row r reads KV head r / G of the task's).
template <typename scalar_t>
void attend(Rows<scalar_t> q, const HeadRows<scalar_t>& cache, int64_t context_len,
            int64_t heads, int64_t group, int64_t dim, float scale, Rows<scalar_t> out,
            Scratch& scratch) {
  const int64_t rows = heads * group;
  scratch.scores.resize(rows * context_len);
  scratch.query.resize(rows * dim);
  scratch.out.assign(rows * dim, 0.f);
  float* scores = scratch.scores.data();
  float* query = scratch.query.data();
  float* acc = scratch.out.data();
  widen_query(q, rows, dim, scale, query);
  for (int64_t t = 0; t < context_len; ++t) {
    if (t + kPrefetchAhead < context_len) prefetch_row(cache.k(t + kPrefetchAhead), heads * dim);
    const scalar_t* k_t = cache.k(t);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* k_head = k_t + (r / group) * dim;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) sum += query[r * dim + i] * simd::widen(k_head[i]);
      scores[r * context_len + t] = sum;
    }
  }
  softmax_rows(scores, rows, context_len);
  for (int64_t t = 0; t < context_len; ++t) {
    if (t + kPrefetchAhead < context_len) prefetch_row(cache.v(t + kPrefetchAhead), heads * dim);
    const scalar_t* v_t = cache.v(t);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* v_head = v_t + (r / group) * dim;
      const float p = scores[r * context_len + t];
      for (int64_t i = 0; i < dim; ++i) acc[r * dim + i] += p * simd::widen(v_head[i]);
    }
  }
  write_out(acc, rows, dim, out);
}

// attend for a head dim known at compile time (a multiple of kLanes): a head row is kChunks
// vectors, widened once into registers while every query head of its group uses it.
template <typename scalar_t, int kDim>
void attend_fixed(Rows<scalar_t> q, const HeadRows<scalar_t>& cache, int64_t context_len,
                  int64_t heads, int64_t group, float scale, Rows<scalar_t> out,
                  Scratch& scratch) {
  constexpr int kChunks = kDim / kLanes;
  const int64_t rows = heads * group;
  scratch.scores.resize(rows * context_len);
  scratch.query.resize(rows * kDim);
  scratch.out.assign(rows * kDim, 0.f);
  scratch.products.resize(rows);
  float* scores = scratch.scores.data();
  float* query = scratch.query.data();
  float* acc = scratch.out.data();
  for (int64_t r = 0; r < rows; ++r) {  // widened and scaled once per task
    for (int c = 0; c < kChunks; ++c) {
      simd::store(query + r * kDim + c * kLanes, simd::load(q.head(r) + c * kLanes) * scale);
    }
  }
  // scores[r * L + t] = q[r] . k[t], kLanes tokens at a time: each token's products for every
  // query row, then each row's kLanes sums in one sum_each.
  for (int64_t tile = 0; tile < context_len; tile += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, context_len - tile);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = tile + i;
      if (t + kPrefetchAhead < context_len) {
        prefetch_row(cache.k(t + kPrefetchAhead), heads * kDim);
      }
      const scalar_t* k_t = cache.k(t);
      for (int64_t h = 0; h < heads; ++h) {
        f32v k[kChunks];
        for (int c = 0; c < kChunks; ++c) k[c] = simd::load(k_t + h * kDim + c * kLanes);
        for (int64_t r = h * group; r < (h + 1) * group; ++r) {
          const float* q_row = query + r * kDim;
          f32v dot = k[0] * simd::load(q_row);
          for (int c = 1; c < kChunks; ++c) dot += k[c] * simd::load(q_row + c * kLanes);
          scratch.products[r].of[i] = dot;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = count; i < kLanes; ++i) scratch.products[r].of[i] = f32v{};
      const f32v sums = simd::sum_each(scratch.products[r].of);
      std::memcpy(scores + r * context_len + tile, &sums, count * sizeof(float));
    }
  }
  softmax_rows(scores, rows, context_len);
  for (int64_t t = 0; t < context_len; ++t) {
    if (t + kPrefetchAhead < context_len) {
      prefetch_row(cache.v(t + kPrefetchAhead), heads * kDim);
    }
    const scalar_t* v_t = cache.v(t);
    for (int64_t h = 0; h < heads; ++h) {
      f32v v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = simd::load(v_t + h * kDim + c * kLanes);
      for (int64_t r = h * group; r < (h + 1) * group; ++r) {
        const float p = scores[r * context_len + t];
        float* o = acc + r * kDim;
        for (int c = 0; c < kChunks; ++c) {
          simd::store(o + c * kLanes, simd::load(o + c * kLanes) + p * v[c]);
        }
      }
    }
  }
  write_out(acc, rows, kDim, out);
}

template <typename scalar_t>
void run(torch::Tensor out, torch::Tensor query, torch::Tensor rows, torch::Tensor key,
         torch::Tensor value, torch::Tensor block_tables, torch::Tensor context_lens,
         double scale) {
  const int64_t num_heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key.size(1), num_kv_heads = key.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = rows.size(0), max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * dim;
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float s = static_cast<float>(scale);
  // Tasks of whole sequences (each K/V row read in one piece) where they keep every thread
  // busy; else one task per KV head, so that a few sequences still spread over the threads.
  const int64_t heads =
      num_seqs >= kWholeRowSeqsPerThread * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads;
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tasks_per_seq, h = (task % tasks_per_seq) * heads;
      const int64_t row = row_ids[n];
      const Rows<scalar_t> q_rows{q + row * query.stride(0) + h * group * query.stride(1),
                                  query.stride(1)};
      const Rows<scalar_t> out_rows{o + row * out.stride(0) + h * group * out.stride(1),
                                    out.stride(1)};
      const HeadRows<scalar_t> cache{
          k + h * dim, v + h * dim,
          token_offsets(tables + n * max_blocks, lens[n], block_size, token_stride,
                        scratch.offsets)};
      if (dim == 64) {
        attend_fixed<scalar_t, 64>(q_rows, cache, lens[n], heads, group, s, out_rows, scratch);
      } else if (dim == 128) {
        attend_fixed<scalar_t, 128>(q_rows, cache, lens[n], heads, group, s, out_rows, scratch);
      } else {
        attend<scalar_t>(q_rows, cache, lens[n], heads, group, dim, s, out_rows, scratch);
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
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t block_size = key.size(1), max_blocks = block_tables.size(1);
  for (int64_t n = 0; n < rows.size(0); ++n) {
    TORCH_CHECK(row_ids[n] >= 0 && row_ids[n] < query.size(0), "a row is outside the step");
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= max_blocks * block_size,
                "a context length is outside 1..its block table's capacity");
    for (int64_t b = 0; b < (lens[n] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[n * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < key.size(0), "a block id is outside the cache");
    }
  }
  if (dtype == at::kFloat) {
    run<float>(out, query, rows, key, value, block_tables, context_lens, scale);
  } else {
    run<c10::BFloat16>(out, query, rows, key, value, block_tables, context_lens, scale);
  }
}

