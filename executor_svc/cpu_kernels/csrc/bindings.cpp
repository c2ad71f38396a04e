// The Python module of the executor's CPU kernels (executor_svc/cpu_kernels/__init__.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache, read in place (float32 or bfloat16)");
  m.def("rms_norm", &rms_norm,
        "weight * (x * rsqrt(mean(x^2) + eps)) over each row, as LlamaRMSNorm (float32 or bfloat16)");
  m.def("rotary_", &rotary_,
        "rotary position embedding of q and k, in place (float32 or bfloat16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, row by row (float32 or bfloat16)");
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>(),
        "causal attention of prompts with no cached prefix over their packed rows "
        "(float32 or bfloat16)");
  m.def("layer_stack", &layer_stack, py::call_guard<py::gil_scoped_release>(),
        "a step of decode rows and fresh prompts through every fused decoder layer, bfloat16 "
        "or float32 (layer_loop.py)");
  m.def("onednn_linear_ops_available", &onednn_linear_ops_available,
        "whether torch's oneDNN linear operators have the signatures layer_stack calls");
  m.def("small_rows_linear", &small_rows_linear, py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("weights"),
        py::arg("bias") = py::none(), py::arg("epilogue") = 0, py::arg("other") = py::none(),
        "x [M, K] @ the weights side by side ^T (+ bias), then none / SiLU / times other, for "
        "1 to SMALL_ROWS_MAX rows on the plain weights (float32 or bfloat16)");
  m.attr("SMALL_ROWS_MAX") = kSmallRowsMax;
  m.attr("EPILOGUE_NONE") = static_cast<int64_t>(kNone);
  m.attr("EPILOGUE_SILU") = static_cast<int64_t>(kSilu);
  m.attr("EPILOGUE_TIMES") = static_cast<int64_t>(kTimes);
  m.def("argmax_logsumexp", &argmax_logsumexp,
        "each row's first maximal id and its log-sum-exp (float32 or bfloat16 logits)");
  m.def("mkl_packed_gemm_available", &mkl_packed_gemm_available,
        "whether torch's build exports MKL's packed GEMM");
  m.def("mkl_pack_weight", &mkl_pack_weight, "a [out, in] float32 weight packed for MKL once");
  m.def("mkl_packed_linear", &mkl_packed_linear, "x [M, in] @ weight^T from its packed copy");
}
