// One row's RMSNorm, and the residual add before it, shared by rms_norm.cpp's operators and the
// quantized projection that adds into the residual stream (quant_linear_norm.cpp): the formula HF's
// LlamaRMSNorm uses, x * rsqrt(mean(x^2) + eps) * weight, in float32.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tiergate_norm {

inline void normalize_row(const float* row, const float* weight, float* out, int64_t hidden, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) out[i] = row[i] * scale * weight[i];
}

// row += add, then out = rms_norm(row) * weight.
inline void add_normalize_row(float* row, const float* add, const float* weight, float* out, int64_t hidden,
                              float eps) {
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) row[i] += add[i];
  normalize_row(row, weight, out, hidden, eps);
}

// Rows per parallel chunk: a norm of a few decode rows is cheaper than waking a thread.
inline int64_t grain_rows(int64_t hidden) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)); }

}  // namespace tiergate_norm
