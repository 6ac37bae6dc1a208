// A pool's heads as the decode kernel reads them (csrc/paged_attention.cpp): float32 or bfloat16
// elements, or the 8-bit pool's Q8_0 blocks (engine/kv_quant.py: per 32 dimensions a float16 scale
// and 32 int8 values, llama.cpp's block). And a head written as Q8_0 from float32, rounding as
// kv_quant.quantize_q8_0 does (half to even, the scale's reciprocal times each value), so both
// writers store the same bytes.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_lanes.h"

namespace tiergate_kv {

using tiergate_simd::LANES;
using tiergate_simd::lanes;

constexpr int64_t Q8_GROUP = 32, Q8_BYTES = 2 + Q8_GROUP;

inline int64_t q8_head_bytes(int64_t head_dim) { return head_dim / Q8_GROUP * Q8_BYTES; }

inline float q8_scale(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, sizeof(bits));
  return _cvtsh_ss(bits);
}

// Lanes [j * LANES, (j + 1) * LANES) of a Q8_0 head, as float32 (a vector never straddles two groups:
// 32 is a multiple of LANES).
inline lanes load_q8_0(const uint8_t* head, int64_t j) {
  const int64_t first = j * LANES;
  const uint8_t* block = head + first / Q8_GROUP * Q8_BYTES;
  const uint8_t* values = block + 2 + first % Q8_GROUP;
#if TIERGATE_LANES == 16
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
  const lanes v = reinterpret_cast<lanes>(_mm512_cvtepi32_ps(wide));
#else
  const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values)));
  const lanes v = reinterpret_cast<lanes>(_mm256_cvtepi32_ps(wide));
#endif
  return v * q8_scale(block);
}

// One Q8_0 group (its scale and 32 values) into 32 float32s at `to`.
inline void widen_q8_0_group(const uint8_t* block, float* to) {
  const float scale = q8_scale(block);
  for (int64_t i = 0; i < Q8_GROUP / LANES; ++i) {
#if TIERGATE_LANES == 16
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + i * LANES)));
    const lanes v = reinterpret_cast<lanes>(_mm512_cvtepi32_ps(wide));
#else
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + i * LANES)));
    const lanes v = reinterpret_cast<lanes>(_mm256_cvtepi32_ps(wide));
#endif
    tiergate_simd::store(to + i * LANES, v * scale);
  }
}

inline float q8_0_at(const uint8_t* head, int64_t d) {
  const uint8_t* block = head + d / Q8_GROUP * Q8_BYTES;
  return static_cast<float>(static_cast<int8_t>(block[2 + d % Q8_GROUP])) * q8_scale(block);
}

// One head of `head_dim` floats (a multiple of 32) into `dst`'s head_dim / 32 blocks.
inline void quantize_q8_0_head(const float* x, int64_t head_dim, uint8_t* dst) {
  for (int64_t g = 0; g < head_dim / Q8_GROUP; ++g, x += Q8_GROUP, dst += Q8_BYTES) {
    float peak = 0.f;
    for (int64_t i = 0; i < Q8_GROUP; ++i) peak = std::max(peak, std::fabs(x[i]));
    const float scale = peak / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    const uint16_t bits = c10::Half(scale).x;
    std::memcpy(dst, &bits, sizeof(bits));
    for (int64_t i = 0; i < Q8_GROUP; ++i)
      dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inverse), -127.f, 127.f)));
  }
}

// A head's keys or values as the pool stores them: float32 or bfloat16 elements ...
template <typename elem_t>
struct PlainHeads {
  static constexpr bool widened = false;
  static int64_t head_bytes(int64_t head_dim) { return head_dim * int64_t(sizeof(elem_t)); }
  static lanes vec(const uint8_t* head, int64_t j) {
    return tiergate_simd::load(reinterpret_cast<const elem_t*>(head) + j * LANES);
  }
  static float at(const uint8_t* head, int64_t d) {
    return static_cast<float>(reinterpret_cast<const elem_t*>(head)[d]);
  }
};

// ... or Q8_0 blocks.
struct Q8Heads {
  static constexpr bool widened = true;  // read through a float32 copy of each block (attend_item)
  static int64_t head_bytes(int64_t head_dim) { return q8_head_bytes(head_dim); }
  static lanes vec(const uint8_t* head, int64_t j) { return load_q8_0(head, j); }
  static float at(const uint8_t* head, int64_t d) { return q8_0_at(head, d); }
};

}  // namespace tiergate_kv
