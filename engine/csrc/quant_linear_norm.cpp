// A quantized projection whose output goes straight into the residual stream and its next norm.
//
// Registered as torch.ops.tiergate.quant_linear_add_rms_norm_: residual += x @ W (quant_linear's
// product, the same bits), then returns rms_norm(residual) * weight, as add_rms_norm_ does after it.
// A decoder layer does this twice (the attention's output projection, the MLP's down projection);
// at a decode step the second call cost more to dispatch from Python than its few rows cost to
// compute, thirty layers over (docs/performance.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rms_norm_row.h"

#include <cstdint>

namespace tiergate_quant {
// quant_linear.cpp's operator.
at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                        at::IntArrayRef out_features, int64_t isa, bool row_prefetch);

at::Tensor quant_linear_add_rms_norm_(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                                      at::IntArrayRef out_features, int64_t isa, bool row_prefetch,
                                      at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == at::kFloat && residual.dim() == 2 &&
                  residual.stride(1) == 1 && residual.size(0) == x.size(0),
              "quant_linear_add_rms_norm_: residual must be a float32 CPU [rows, out] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == residual.size(1), "quant_linear_add_rms_norm_: weight must be float32 [out]");
  const at::Tensor delta = tiergate_quant::quant_linear(x, blocks, types, out_features, isa, row_prefetch);
  TORCH_CHECK(delta.size(1) == residual.size(1), "quant_linear_add_rms_norm_: the weights give ", delta.size(1),
              " outputs, the residual has ", residual.size(1));
  const int64_t rows = residual.size(0), hidden = residual.size(1), stride = residual.stride(0);
  at::Tensor out = at::empty({rows, hidden}, residual.options());
  float* h = residual.mutable_data_ptr<float>();
  const float* d = delta.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, tiergate_norm::grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      tiergate_norm::add_normalize_row(h + r * stride, d + r * hidden, w, dst + r * hidden, hidden, float(eps));
  });
  return out;
}

}  // namespace tiergate_quant

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("quant_linear_add_rms_norm_(Tensor x, Tensor[] blocks, int[] types, int[] out_features, int isa, "
        "bool row_prefetch, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.impl("quant_linear_add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(tiergate_quant::quant_linear_add_rms_norm_));
}
