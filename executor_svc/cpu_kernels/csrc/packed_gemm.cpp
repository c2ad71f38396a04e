// float32 linear layers through MKL's packed GEMM: the weight laid out for the GEMM kernel once
// at load, not on every call.
//
//   mkl_packed_gemm_available() -> bool
//   mkl_pack_weight(weight [N, K] float32) -> packed (an opaque byte buffer)
//   mkl_packed_linear(x [M, K] float32, packed, N) -> x @ weight^T [M, N]
//
// torch's F.linear calls MKL's sgemm with the weight transposed, and sgemm copies ("packs") the
// weight into its kernel's layout on every call (mkl_blas_*_sgemm_scopy_* in a profile of a
// decode step). cblas_sgemm_pack does that once and cblas_sgemm_compute reuses it, for any M.
// The products equal sgemm's up to the order of float sums.
//
// MKL is linked into torch's x86 CPU builds, which export its CBLAS symbols; other builds
// (aarch64, a torch built without MKL) do not. So the symbols are looked up at run time:
// where they are missing, mkl_packed_gemm_available() is false and the executor keeps F.linear.
//
// A packed buffer must stay where it was written (MKL's documentation: never copy it to another
// address); the executor keeps it as a module attribute and never moves it.
#include "kernels.h"

#include <dlfcn.h>

namespace {

// mkl_cblas.h's values (CBLAS_LAYOUT, CBLAS_TRANSPOSE, CBLAS_IDENTIFIER, CBLAS_STORAGE).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kBMatrix = 162, kPacked = 151;
// The M MKL is told at packing; it only sizes the layout's blocking (products are correct for
// any M, tested from 1 to 2,048 rows).
constexpr int kPackForRows = 64;

using PackGetSize = size_t (*)(int identifier, int m, int n, int k);
using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest);
using Compute = void (*)(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc);

struct Mkl {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  bool ok() const { return get_size && pack && compute; }
};

const Mkl& mkl() {
  static const Mkl found = [] {
    Mkl m;
    m.get_size = reinterpret_cast<PackGetSize>(dlsym(RTLD_DEFAULT, "cblas_sgemm_pack_get_size"));
    m.pack = reinterpret_cast<Pack>(dlsym(RTLD_DEFAULT, "cblas_sgemm_pack"));
    m.compute = reinterpret_cast<Compute>(dlsym(RTLD_DEFAULT, "cblas_sgemm_compute"));
    return m;
  }();
  return found;
}

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value > 0 && value <= INT32_MAX, what, " out of MKL's int range: ", value);
  return static_cast<int>(value);
}

}  // namespace

bool mkl_packed_gemm_available() { return mkl().ok(); }

torch::Tensor mkl_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(mkl().ok(), "MKL's packed GEMM is not in this torch build");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 &&
                  weight.device().is_cpu(),
              "mkl_pack_weight: a 2-D float32 CPU weight [out, in]");
  weight = weight.contiguous();
  const int n = checked_int(weight.size(0), "out_features");
  const int k = checked_int(weight.size(1), "in_features");
  const size_t bytes = mkl().get_size(kBMatrix, kPackForRows, n, k);
  auto packed = torch::empty({static_cast<int64_t>(bytes)}, torch::kUInt8);  // 64-byte aligned
  // B = weight^T: the [N, K] weight read transposed, leading dimension K.
  mkl().pack(kRowMajor, kBMatrix, kTrans, kPackForRows, n, k, 1.0f, weight.data_ptr<float>(), k,
             reinterpret_cast<float*>(packed.data_ptr<uint8_t>()));
  return packed;
}

torch::Tensor mkl_packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "mkl_packed_linear: x must be 2-D float32 on the CPU");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "mkl_packed_linear: packed must come from mkl_pack_weight");
  x = x.contiguous();
  const int m = checked_int(x.size(0), "rows");
  const int k = checked_int(x.size(1), "in_features");
  const int n = checked_int(out_features, "out_features");
  TORCH_CHECK(static_cast<size_t>(packed.numel()) >= mkl().get_size(kBMatrix, kPackForRows, n, k),
              "mkl_packed_linear: packed buffer too small for [", n, ", ", k, "]");
  auto out = torch::empty({m, n}, x.options());
  mkl().compute(kRowMajor, kNoTrans, kPacked, m, n, k, x.data_ptr<float>(), k,
                reinterpret_cast<const float*>(packed.data_ptr<uint8_t>()), k, 0.0f,
                out.data_ptr<float>(), n);
  return out;
}
