// One vector register of float32 lanes and what the kernels do with them, written with GCC's
// vector extensions: sixteen lanes with AVX-512, eight with AVX2. A wider vector type than
// the hardware's has no machine mode, and GCC keeps it in memory, every operation a store
// and a load, which made the kernels several times slower than torch on AVX2.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
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

// The sums of LANES vectors at once: lane i of the result is sum_lanes(v[i]). Pairs are folded in
// halves, quarters, ... (a shuffle pair and an add each), so each vector costs about three
// operations rather than sum_lanes' eight; the folds leave the sums in bit-reversed lane order,
// which the last shuffle undoes. The order of the additions differs from sum_lanes'.
#if TIERGATE_LANES == 16
inline lanes sum_each(const lanes (&v)[16]) {
  lanes h[8], q[4], e[2];
  for (int i = 0; i < 8; ++i)
    h[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const lanes r = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                  __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#else
inline lanes sum_each(const lanes (&v)[8]) {
  lanes q[4], e[2];
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const lanes r = __builtin_shufflevector(e[0], e[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(e[0], e[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(r, r, 0, 4, 2, 6, 1, 5, 3, 7);
}
#endif

inline lanes max_each(lanes a, lanes b) { return a > b ? a : b; }

// The largest lane, folded in halves (as sum_lanes): a chain of LANES - 1 dependent maxima took longer.
inline float max_lanes(lanes v) {
  typedef float half_lanes __attribute__((vector_size(8 * sizeof(float))));
  typedef float quarter_lanes __attribute__((vector_size(4 * sizeof(float))));
#if TIERGATE_LANES == 16
  const half_lanes lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const half_lanes hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const half_lanes h = lo > hi ? lo : hi;
#else
  const half_lanes h = v;
#endif
  const quarter_lanes a = __builtin_shufflevector(h, h, 0, 1, 2, 3), b = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const quarter_lanes q = a > b ? a : b;
  return std::max(std::max(q[0], q[2]), std::max(q[1], q[3]));
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
