// RMSNorm on the CPU, alone or fused with the residual add before it.
//
// Registered as torch.ops.tiergate.rms_norm and torch.ops.tiergate.add_rms_norm_.
// The forward's norms run on a few rows at decode, where torch's rms_norm is a
// chain of small ops (square, mean, rsqrt, two multiplies) each paying its own
// dispatch and allocation; here a row is one pass to sum its squares and one to
// scale it. add_rms_norm_ also adds the layer's output into the residual stream
// in the same pass, as the forward does just before each norm. Float32 only, the
// formula HF's LlamaRMSNorm uses: x * rsqrt(mean(x^2) + eps) * weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rms_norm_row.h"

namespace {

using tiergate_norm::grain_rows;
using tiergate_norm::normalize_row;

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "weight must be [hidden]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  const float* src = x.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(src + r * stride, w, dst + r * hidden, hidden, float(eps));
  });
  return out;
}

// residual += delta, then returns rms_norm(residual).
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check(residual, weight);
  TORCH_CHECK(delta.scalar_type() == at::kFloat && delta.dim() == 2 && delta.stride(1) == 1 &&
                  delta.size(0) == residual.size(0) && delta.size(1) == residual.size(1),
              "delta must be a float32 [rows, hidden] with contiguous rows");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  const int64_t stride = residual.stride(0), delta_stride = delta.stride(0);
  at::Tensor out = at::empty({rows, hidden}, residual.options());
  float* h = residual.mutable_data_ptr<float>();
  const float* d = delta.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      tiergate_norm::add_normalize_row(h + r * stride, d + r * delta_stride, w, dst + r * hidden, hidden, float(eps));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
}
