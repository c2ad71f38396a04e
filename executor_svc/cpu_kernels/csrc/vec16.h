// Sixteen float32 lanes in gcc's vector extensions, with loads and stores that widen and
// round bfloat16: one source that gcc compiles for whatever the build targets (AVX-512 as one
// register, AVX2 as two, SSE as four), so the kernels need no per-instruction-set copies.
// Below them, the same conversions one element at a time, for loops gcc vectorises itself
// (bf16 handled as its bits: c10::BFloat16's own conversions it does not vectorise).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace vec16 {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load(const c10::BFloat16* p) {  // bfloat16 is float32's upper half: exact
  u16x16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const u32x16 wide = __builtin_convertvector(bits, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// Rounded to the nearest bfloat16, ties to even, as c10::BFloat16(float) rounds (finite values:
// the kernels make no NaNs, and fast-math assumes none).
inline void store(c10::BFloat16* p, f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += ((bits >> 16) & 1) + 0x7fff;
  const u16x16 narrow = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &narrow, sizeof narrow);
}

inline float sum(f32x16 v) {
  const f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                     __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
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

}  // namespace vec16
