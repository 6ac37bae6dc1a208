// One vector register of float32 lanes and what the kernels do with them, written with GCC's
// vector extensions: sixteen lanes with AVX-512, eight with AVX2. A wider vector type than
// the hardware's has no machine mode, and GCC keeps it in memory, every operation a store
// and a load, which made the kernels several times slower than torch on AVX2.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace tiergate_simd {

#if defined(__AVX512F__)
#define TIERGATE_LANES 16
#else
#define TIERGATE_LANES 8
#endif
constexpr int64_t LANES = TIERGATE_LANES;
// Heads of up to 256 dimensions in whole vectors (the attention kernels' template range).
constexpr int MAX_HEAD_VECS = 256 / LANES;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t int_lanes __attribute__((vector_size(LANES * sizeof(int32_t))));

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A bfloat16 is the top half of a float32: widen the 16 bit patterns and shift them up. Written
// with intrinsics: GCC lowers the vector-extension form of the widening to two half-width widenings
// and an insert, three shuffles where one zero-extending load does.
inline lanes load(const c10::BFloat16* p) {
#if TIERGATE_LANES == 16
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<lanes>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#else
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<lanes>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
#endif
}

inline float sum_lanes(lanes v) {
  typedef float half_lanes __attribute__((vector_size(8 * sizeof(float))));
  typedef float quarter_lanes __attribute__((vector_size(4 * sizeof(float))));
#if TIERGATE_LANES == 16
  const half_lanes h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const half_lanes h = v;
#endif
  const quarter_lanes q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

inline float max_lanes(lanes v) {
  float m = v[0];
  for (int64_t l = 1; l < LANES; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

inline void store(float* p, const lanes& v) { std::memcpy(p, &v, sizeof(v)); }

// e^x lane by lane, to within a few float32 ulps: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' expf polynomial, 2^n built in the exponent bits. -inf and anything below the
// smallest normal's log give 0 (masked positions must weigh nothing); anything above 88
// gives e^88, near the largest float, rather than overflowing the exponent bits.
inline lanes exp_lanes(lanes x) {
  x = x > (lanes{} + 88.f) ? lanes{} + 88.f : x;
  const int_lanes underflow = x < (lanes{} - 87.3f);
  x = underflow ? lanes{} : x;  // keep the arithmetic finite; those lanes are zeroed below
  const float round_magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const lanes n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const lanes r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int_lanes exponent = (__builtin_convertvector(n, int_lanes) + 127) << 23;
  lanes two_n;
  std::memcpy(&two_n, &exponent, sizeof(two_n));
  return underflow ? lanes{} : p * two_n;
}

}  // namespace tiergate_simd
