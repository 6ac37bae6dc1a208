// The AVX-512 VNNI path for a few rows of x (decode steps): each 64 inputs of a weight row are
// decoded from the GGUF bytes into registers and multiplied at once, so the weight streams
// from memory with no scratch copy between. Per 64 inputs a format gives
//   u  64 unsigned quants (one zmm of bytes, in input order),
//   d  the float scale of each int32 lane (a lane sums 4 inputs' products),
//   m  the float offset of each lane (formats with a min: Q4_1, Q5_1, Q4_K, Q5_K), or
//   an integer offset (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q8_0's 128 after flipping its sign bit), which
//      enters the int32 dot as -offset * sum(x) through dpbusd's accumulator, for free.
// Used for up to FUSED_MAX_ROWS rows; more rows amortize a decode over more of them in
// quant_linear.cpp's scratch tiles.

#include <immintrin.h>

#include "quant_formats.h"
#include "quant_kernels.h"

#include <algorithm>

namespace tiergate_quant {
namespace {

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

constexpr int OUTS = 4;  // weight rows decoded per pass over x's rows

struct Chunk {
  __m512i u;
  __m512 d, m;
};

TARGET_AVX512 inline float half(const uint8_t* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Two 16-byte runs of nibbles (blocks a and b: low nibbles are inputs 0-15, high 16-31) as 64 bytes.
TARGET_AVX512 inline __m512i nibbles_of_two_blocks(const uint8_t* a, const uint8_t* b) {
  const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                             _mm_loadu_si128((const __m128i*)b), 1);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(qs, mask), hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), mask);
  const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo a, lo b, hi a, hi b]
  return _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));               // [lo a, hi a, lo b, hi b]
}

// 32 bytes whose low nibbles are one sub-block's 32 inputs and high nibbles the next's.
TARGET_AVX512 inline __m512i nibbles_of_32_bytes(const uint8_t* p) {
  const __m256i qs = _mm256_loadu_si256((const __m256i*)p);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(qs, mask)),
                            _mm256_and_si256(_mm256_srli_epi16(qs, 4), mask), 1);
}

// Each format's Decoder reads a row in steps of PER chunks of 64 inputs (a block pair, or a
// K-format super-block): prepare() once per step (what its chunks share: a super-block's
// scales), then at() per chunk.
template <int64_t TYPE>
struct Decoder;

// Lanes 0-7 from v[a], 8-15 from v[b].
TARGET_AVX512 inline __m512 two_lanes(__m512 v, int a, int b) {
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1), v);
}

// The float16 fields at `offset` of up to 8 blocks of `bytes` from `block`, as floats in lanes
// 0-7 (lanes past `count` zero). Gathered by inserts: narrow stores then one wide load would
// stall on store forwarding.
TARGET_AVX512 inline __m256 halves_of_blocks(const uint8_t* block, int64_t bytes, int offset, int64_t count) {
  __m128i h = _mm_setzero_si128();
  uint16_t v[8];
  for (int64_t b = 0; b < 8; ++b) {
    if (b < count) __builtin_memcpy(&v[b], block + b * bytes + offset, 2);
    else v[b] = 0;
  }
  h = _mm_insert_epi16(h, v[0], 0), h = _mm_insert_epi16(h, v[1], 1), h = _mm_insert_epi16(h, v[2], 2);
  h = _mm_insert_epi16(h, v[3], 3), h = _mm_insert_epi16(h, v[4], 4), h = _mm_insert_epi16(h, v[5], 5);
  h = _mm_insert_epi16(h, v[6], 6), h = _mm_insert_epi16(h, v[7], 7);
  return _mm256_cvtph_ps(h);
}

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: a step is 8 blocks (4 chunks); prepare() gathers their scales
// (and Q4_1's / Q5_1's mins) into lanes 0-7 (8-15) of one vector.
template <int64_t TYPE>
struct BlockDecoder {
  static constexpr int64_t BYTES = format_of(TYPE).block_bytes;
  static constexpr int OFFSET = TYPE == Q8_0 ? 128 : TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : 0, PER = 4;
  static constexpr bool MIN = TYPE == Q4_1 || TYPE == Q5_1;
  static constexpr bool FIVE = TYPE == Q5_0 || TYPE == Q5_1;
  TARGET_AVX512 static __m512 prepare(const uint8_t* row, int64_t step, int64_t blocks) {
    const uint8_t* first = row + step * 8 * BYTES;
    const int64_t count = std::min<int64_t>(8, blocks - step * 8);
    const __m256 d = halves_of_blocks(first, BYTES, 0, count);
    const __m256 m = MIN ? halves_of_blocks(first, BYTES, 2, count) : _mm256_setzero_ps();
    return _mm512_insertf32x8(_mm512_castps256_ps512(d), m, 1);
  }
  TARGET_AVX512 static Chunk at(const uint8_t* row, int64_t step, int i, __m512 scales) {
    const uint8_t* a = row + (step * 8 + 2 * i) * BYTES;
    __m512i u;
    if (TYPE == Q8_0) {
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 2))),
                                           _mm256_loadu_si256((const __m256i*)(a + 36)), 1);
      u = _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
    } else if (FIVE) {
      // Bit k of a block's 32-bit qh tops its input k: the two blocks' qh are one mask of the 64 bytes.
      const int at_qh = TYPE == Q5_0 ? 2 : 4;
      uint32_t qh[2];
      __builtin_memcpy(&qh[0], a + at_qh, 4);
      __builtin_memcpy(&qh[1], a + BYTES + at_qh, 4);
      const __mmask64 high = __mmask64(qh[0]) | (__mmask64(qh[1]) << 32);
      u = _mm512_or_si512(nibbles_of_two_blocks(a + at_qh + 4, a + BYTES + at_qh + 4),
                          _mm512_maskz_set1_epi8(high, 0x10));
    } else {
      const int qs = TYPE == Q4_0 ? 2 : 4;
      u = nibbles_of_two_blocks(a + qs, a + BYTES + qs);
    }
    return {u, two_lanes(scales, 2 * i, 2 * i + 1), MIN ? two_lanes(scales, 8 + 2 * i, 9 + 2 * i) : _mm512_setzero_ps()};
  }
};

template <>
struct Decoder<Q8_0> : BlockDecoder<Q8_0> {};
template <>
struct Decoder<Q4_0> : BlockDecoder<Q4_0> {};
template <>
struct Decoder<Q4_1> : BlockDecoder<Q4_1> {};
template <>
struct Decoder<Q5_0> : BlockDecoder<Q5_0> {};
template <>
struct Decoder<Q5_1> : BlockDecoder<Q5_1> {};

// Q4_K and Q5_K: a super-block's eight 6-bit scales and mins (quant_formats.h's scale_min_k4,
// all at once on three 32-bit words) as 16 floats: d * scale for sub-blocks 0-7, then -dmin * min.
TARGET_AVX512 inline __m512 k_scales(const uint8_t* block) {
  uint32_t w[3];
  __builtin_memcpy(w, block + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t packed[4] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & top2) << 4), w[1] & low6,
                              ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4)};
  const __m512 ints = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)packed)));
  const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(half(block)), _mm256_set1_ps(-half(block + 2)), 1);
  return _mm512_mul_ps(ints, factors);
}

// Chunk i of a K super-block: sub-blocks 2i (low nibbles of 32 bytes) and 2i+1 (high nibbles).
template <int64_t TYPE>
struct KDecoder {
  static constexpr int OFFSET = 0, PER = 4;
  static constexpr bool MIN = true;
  static constexpr int64_t BYTES = TYPE == Q4_K ? 144 : 176, QS = TYPE == Q4_K ? 16 : 48;
  TARGET_AVX512 static __m512 prepare(const uint8_t* row, int64_t step, int64_t) { return k_scales(row + step * BYTES); }
  TARGET_AVX512 static Chunk at(const uint8_t* row, int64_t step, int i, __m512 scales) {
    const uint8_t* block = row + step * BYTES;
    __m512i u = nibbles_of_32_bytes(block + QS + 32 * i);
    if (TYPE == Q5_K) {
      // Bit j of qh[l] is the fifth bit of input l of sub-block j: bits 2i and 2i+1 here, moved to bit 4.
      const __m256i qh32 = _mm256_loadu_si256((const __m256i*)(block + 16));
      const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh32), qh32, 1);
      const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(short(2 * i)), _mm256_set1_epi16(short(2 * i + 1)), 1);
      const __m512i bit4 = _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, shifts), 4), _mm512_set1_epi8(0x10));
      u = _mm512_or_si512(u, bit4);
    }
    return {u, two_lanes(scales, 2 * i, 2 * i + 1), two_lanes(scales, 8 + 2 * i, 9 + 2 * i)};
  }
};

template <>
struct Decoder<Q4_K> : KDecoder<Q4_K> {};
template <>
struct Decoder<Q5_K> : KDecoder<Q5_K> {};

template <>
struct Decoder<Q6_K> {
  static constexpr int OFFSET = 32, PER = 4;
  static constexpr bool MIN = false;
  // d times the 16 int8 scales, one per 16 inputs.
  TARGET_AVX512 static __m512 prepare(const uint8_t* row, int64_t step, int64_t) {
    const uint8_t* block = row + step * 210;
    const __m512 ints = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 192))));
    return _mm512_mul_ps(ints, _mm512_set1_ps(half(block + 208)));
  }
  // Chunk i is inputs 64i..64i+63: half h = i / 2, part p = i % 2 of that half. Their low 4
  // bits: nibble p of ql[64h..64h+63]; their top 2: bits 4p (first 32) and 4p + 2 (last 32)
  // of qh[32h..32h+31].
  TARGET_AVX512 static Chunk at(const uint8_t* row, int64_t step, int i, __m512 scales) {
    const uint8_t* block = row + step * 210;
    const int h = i / 2, p = i % 2;
    const __m512i ql = _mm512_loadu_si512(block + 64 * h);
    const __m512i low = _mm512_and_si512(p ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m256i qh32 = _mm256_loadu_si256((const __m256i*)(block + 128 + 32 * h));
    const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh32), qh32, 1);
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(short(4 * p)), _mm256_set1_epi16(short(4 * p + 2)), 1);
    const __m512i top = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shifts), _mm512_set1_epi8(3)), 4);
    const __m512i idx = _mm512_set_epi32(4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 2, 4 * i + 2, 4 * i + 2,
                                         4 * i + 2, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i, 4 * i, 4 * i, 4 * i);
    return {_mm512_or_si512(low, top), _mm512_permutexvar_ps(idx, scales), _mm512_setzero_ps()};
  }
};

template <int64_t TYPE, int ROWS>
TARGET_AVX512 void run(const FusedArgs& a) {
  using D = Decoder<TYPE>;
  const Acts& x = *a.acts;
  const int64_t chunks = a.in / 64, lanes_per_row = x.in_pad / 4, blocks = a.in / format_of(TYPE).block_values;
  const __m512i zero = _mm512_setzero_si512(), offset = _mm512_set1_epi8(char(D::OFFSET)), ones = _mm512_set1_epi8(1);
  for (int64_t o0 = 0; o0 < a.count; o0 += OUTS) {
    // Past the last output, repeat it (computed, not stored): a tile always has OUTS rows.
    const uint8_t* w[OUTS];
    for (int o = 0; o < OUTS; ++o) w[o] = a.blocks + (a.first + std::min<int64_t>(o0 + o, a.count - 1)) * a.row_bytes;
    __m512 acc[ROWS][OUTS];
    for (int r = 0; r < ROWS; ++r)
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_ps();
    for (int64_t step = 0; step * D::PER < chunks; ++step) {
      __m512 prepared[OUTS];
      for (int o = 0; o < OUTS; ++o) prepared[o] = D::prepare(w[o], step, blocks);
#pragma GCC unroll 4
      for (int i = 0; i < D::PER; ++i) {
        const int64_t c = step * D::PER + i;
        if (c == chunks) break;  // a row of 32-input blocks may end inside a step
        Chunk wc[OUTS];
        for (int o = 0; o < OUTS; ++o) wc[o] = D::at(w[o], step, i, prepared[o]);
        for (int r = 0; r < ROWS; ++r) {
          const int64_t row = a.row0 + r;
          const __m512i q = _mm512_loadu_si512(x.q.data() + row * x.in_pad + c * 64);
          const __m512 xd = _mm512_loadu_ps(x.lanes.data() + row * lanes_per_row + c * 16);
          __m512i start = zero;
          if (D::OFFSET) start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, q));
          __m512 xs = _mm512_setzero_ps();
          if (D::MIN) xs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ones, q)), xd);
          for (int o = 0; o < OUTS; ++o) {
            const __m512i dot = _mm512_dpbusd_epi32(start, wc[o].u, q);
            acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(xd, wc[o].d), acc[r][o]);
            if (D::MIN) acc[r][o] = _mm512_fmadd_ps(wc[o].m, xs, acc[r][o]);
          }
        }
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int o = 0; o < OUTS && o0 + o < a.count; ++o) a.out[r * a.out_stride + o0 + o] = _mm512_reduce_add_ps(acc[r][o]);
  }
}

template <int64_t TYPE>
void run_rows(const FusedArgs& a) {
  switch (a.rows) {
    case 1: return run<TYPE, 1>(a);
    case 2: return run<TYPE, 2>(a);
    case 3: return run<TYPE, 3>(a);
    default: return run<TYPE, 4>(a);
  }
}

// One row into quant_linear.cpp's scratch form (quant_formats.h's decode_row), for the tiles of
// many rows: u as bytes, and per 16 inputs d and m (an integer offset becomes m = -offset * d).
template <int64_t TYPE>
TARGET_AVX512 void decode_into(const uint8_t* row, int64_t in, uint8_t* q, float* d16, float* m16) {
  using D = Decoder<TYPE>;
  const int64_t chunks = in / 64, blocks = in / format_of(TYPE).block_values;
  const __m512i every4 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  for (int64_t step = 0; step * D::PER < chunks; ++step) {
    const __m512 prepared = D::prepare(row, step, blocks);
    for (int i = 0; i < D::PER; ++i) {
      const int64_t c = step * D::PER + i;
      if (c == chunks) break;
      const Chunk w = D::at(row, step, i, prepared);
      _mm512_storeu_si512(q + c * 64, w.u);
      const __m128 d = _mm512_castps512_ps128(_mm512_permutexvar_ps(every4, w.d));
      _mm_storeu_ps(d16 + c * 4, d);
      _mm_storeu_ps(m16 + c * 4, D::MIN ? _mm512_castps512_ps128(_mm512_permutexvar_ps(every4, w.m))
                                        : _mm_mul_ps(d, _mm_set1_ps(-float(D::OFFSET))));
    }
  }
}

}  // namespace

bool decode_avx512(int64_t type, const uint8_t* row, int64_t in, uint8_t* q, float* d16, float* m16) {
  if (in % 64) return false;
  switch (type) {
    case Q4_0: decode_into<Q4_0>(row, in, q, d16, m16); return true;
    case Q4_1: decode_into<Q4_1>(row, in, q, d16, m16); return true;
    case Q5_0: decode_into<Q5_0>(row, in, q, d16, m16); return true;
    case Q5_1: decode_into<Q5_1>(row, in, q, d16, m16); return true;
    case Q4_K: decode_into<Q4_K>(row, in, q, d16, m16); return true;
    case Q5_K: decode_into<Q5_K>(row, in, q, d16, m16); return true;
    case Q6_K: decode_into<Q6_K>(row, in, q, d16, m16); return true;
    default: return false;  // Q8_0's scratch form is its int8 bytes as they are: decode_row copies them
  }
}

bool fused_avx512(const FusedArgs& a) {
  if (a.in % 64) return false;  // a 32-input format with an odd number of blocks: the scratch tiles take it
  switch (a.type) {
    case Q8_0: run_rows<Q8_0>(a); return true;
    case Q4_0: run_rows<Q4_0>(a); return true;
    case Q4_1: run_rows<Q4_1>(a); return true;
    case Q5_0: run_rows<Q5_0>(a); return true;
    case Q5_1: run_rows<Q5_1>(a); return true;
    case Q4_K: run_rows<Q4_K>(a); return true;
    case Q5_K: run_rows<Q5_K>(a); return true;
    case Q6_K: run_rows<Q6_K>(a); return true;
    default: return false;
  }
}

}  // namespace tiergate_quant
