// One head rotated in place by RoPE, shared by pointwise.cpp's rope_ and paged_attention.cpp's
// rope_decode_attention: x * cos + rotate_half(x) * sin, with the sign folded into sin (engine/rope.py),
// where rotate_half swaps the head's two halves.

#pragma once

#include <cstdint>

namespace tiergate_rope {

inline void rotate_head(float* v, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] + b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace tiergate_rope
