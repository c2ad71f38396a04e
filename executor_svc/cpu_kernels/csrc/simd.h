// float32 vectors of the target's register width in gcc's vector extensions (16 lanes with
// AVX-512, else 8: AVX2's register, SSE's two), with loads that widen bfloat16: one source
// that gcc compiles for whatever the build targets (one intrinsic where AVX-512 has it), so
// the kernels need no per-instruction-set copies. (16 lanes on an AVX2 build, two registers each, ran the
// decode attention 2.5x slower than 8: the fixed-size path's K rows no longer fit the 16
// registers.)
// Below them, the same conversions one element at a time, for loops gcc vectorises itself
// (bf16 handled as its bits: c10::BFloat16's own conversions it does not vectorise).
#pragma once

#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace simd {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float f32v __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline f32v load(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32v load(const c10::BFloat16* p) {  // bfloat16 is float32's upper half: exact
#if defined(__AVX512F__)
  // One 512-bit widening: gcc's own conversion of the vector below, tuned for AMD's Zen 4,
  // took two 256-bit halves and an insert (a bf16 weight read at 24 GB/s, 38 with this).
  const __m512i wide = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<f32v>(_mm512_castsi512_ps(wide));
#else
  u16v bits;
  std::memcpy(&bits, p, sizeof bits);
  const u32v wide = __builtin_convertvector(bits, u32v) << 16;
  f32v v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#endif
}

inline void store(float* p, f32v v) { std::memcpy(p, &v, sizeof v); }

inline float sum(f32v v) {
#if defined(__AVX512F__)
  const f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f32x8 eight = v;
#endif
  const f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                     __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// Lane i of the result: the sum of v[i]'s lanes. A tree of shuffles and adds: each level
// halves the vectors and doubles the inputs each holds, so kLanes sums cost kLanes - 1 adds
// and twice as many shuffles, where kLanes separate sum()s cost several times that. The tree
// pairs its inputs in bit-reversed order, which puts input i's sum in lane i.
inline f32v sum_each(const f32v (&v)[kLanes]) {
#if defined(__AVX512F__)
  constexpr int kReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  f32v half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; ++i) {
    const f32v a = v[kReversed[2 * i]], b = v[kReversed[2 * i + 1]];
    half[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const f32v a = half[2 * i], b = half[2 * i + 1];
    quarter[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const f32v a = quarter[2 * i], b = quarter[2 * i + 1];
    eighth[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  const f32v a = eighth[0], b = eighth[1];
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#else
  constexpr int kReversed[8] = {0, 4, 2, 6, 1, 5, 3, 7};
  f32v half[4], quarter[2];
  for (int i = 0; i < 4; ++i) {
    const f32v a = v[kReversed[2 * i]], b = v[kReversed[2 * i + 1]];
    half[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const f32v a = half[2 * i], b = half[2 * i + 1];
    quarter[i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  const f32v a = quarter[0], b = quarter[1];
  return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
#endif
}

// One element: widened to float32, rounded as a torch op on scalar_t tensors rounds its float32
// result (the second argument only picks the type), and stored as scalar_t.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t bf16_bits(float f) {  // round to nearest, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits + ((bits >> 16) & 1) + 0x7fff) >> 16;
}

inline float rounded(float f, float) { return f; }
inline float rounded(float f, c10::BFloat16) {
  const uint32_t bits = bf16_bits(f) << 16;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

inline void narrow(float f, float* dst) { *dst = f; }
inline void narrow(float f, c10::BFloat16* dst) { dst->x = static_cast<uint16_t>(bf16_bits(f)); }

}  // namespace simd
