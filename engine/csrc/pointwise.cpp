// The forward's elementwise steps on the CPU that torch runs as several ops each.
//
// Registered as torch.ops.tiergate.rope_ and torch.ops.tiergate.silu_mul, float32.
// rope_ rotates the query and key heads of a step in place (torch: two slices, a cat,
// a multiply and an addcmul); silu_mul is the gated MLP's silu(gate) * up (torch: two
// ops and a temporary). At a decode step each torch op costs more to dispatch than to
// compute, thirty layers over, so one call each saves most of their time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rope_rotate.h"
#include "simd_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using namespace tiergate_simd;

// x [tokens, heads, dim] (rows and heads strided, dims contiguous) rotated in place by
// cos and the sign-folded sin [tokens, 1, dim] (contiguous): x * cos + rotate_half(x) * sin,
// where rotate_half swaps the two halves of each head.
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "rope_: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, even dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.numel() == x.size(0) * x.size(2),
              "cos and sin must be contiguous [tokens, 1, dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row = x.stride(0), head = x.stride(1);
  float* data = x.mutable_data_ptr<float>();
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) tiergate_rope::rotate_head(data + t * row + h * head, ct, st, half);
    }
  });
}

inline lanes silu_lanes(lanes g) { return g / (1.f + exp_lanes(-g)); }

// gate_up [rows, 2 * inter] (rows strided): silu(gate_up[:, :inter]) * gate_up[:, inter:].
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat, "silu_mul: float32 CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * inter,
              "gate_up must be [rows, 2 * inter] with contiguous rows");
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* src = gate_up.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = src + r * stride;
      const float* up = gate + inter;
      float* o = dst + r * inter;
      int64_t i = 0;
      for (; i + LANES <= inter; i += LANES) store(o + i, silu_lanes(load(gate + i)) * load(up + i));
      for (; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, int inter) -> Tensor");
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
