// GGUF block formats read into the one form the quantized kernels multiply.
//
// A weight row (ggml: one output feature, its blocks along the inputs) is decoded, for a
// stretch of inputs, into
//   q[i]   its quant as a byte: unsigned (0..63) for every format but Q8_0, whose int8 stays signed,
//   d[j]   a float scale per 16 inputs,
//   m[j]   a float offset per 16 inputs (zero for Q8_0),
// with weight[i] = d[i / 16] * q[i] + m[i / 16]. Each of these is exact: a float16 scale times
// a 6- or 8-bit integer has at most 19 significant bits, which float32 holds, so the kernels
// multiply the file's values with no second rounding. Offsets of the symmetric formats
// (Q4_0's -8, Q6_K's -32) become m = -8d and -32d, so the integer dot products only ever see
// unsigned weights, which is what the u8 x s8 instructions (VNNI's dpbusd, AVX2's maddubs) take.
// ggml's block layouts are from its ggml-common.h (the same as gguf-py's dequantizers).
#pragma once

#include <c10/util/Half.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace tiergate_quant {

// gguf.GGMLQuantizationType's values.
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t block_values;  // inputs per block
  int64_t block_bytes;
};

inline bool known(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K || type == Q5_K || type == Q6_K;
}

constexpr Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    default: return {256, 210};  // Q6_K
  }
}

// Bytes of one ggml row of `in` inputs.
constexpr int64_t row_bytes_of(int64_t type, int64_t in) {
  return in / format_of(type).block_values * format_of(type).block_bytes;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction where the build's CPU has it; c10's is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_K/Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes: the low 6 bits of bytes
// 0-3 (scales) and 4-7 (mins) for sub-blocks 0-3; for 4-7 a nibble of bytes 8-11 plus the top
// two bits of bytes 0-3 (scales) or 4-7 (mins).
inline void scale_min_k4(int j, const uint8_t* s, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Runs of bytes as one vector each (GCC's vector extension): the byte loops did not vectorize.
typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef uint8_t bytes32 __attribute__((vector_size(32)));

// The inputs [first_block * block_values, (first_block + blocks) * block_values) of one row,
// for one format (TYPE fixed, so each block's loops compile without a switch around them).
template <int64_t TYPE>
inline void decode_blocks(const uint8_t* row, int64_t first_block, int64_t blocks, uint8_t* q, float* d, float* m) {
  constexpr int64_t type = TYPE;
  const Format f = format_of(type);
  const uint8_t* b = row + first_block * f.block_bytes;
  for (int64_t blk = 0; blk < blocks; ++blk, b += f.block_bytes) {
    switch (type) {
      case Q8_0: {
        std::memcpy(q, b + 2, 32);
        d[0] = d[1] = half_at(b);
        m[0] = m[1] = 0.f;
        q += 32, d += 2, m += 2;
        break;
      }
      case Q4_0:
      case Q4_1: {
        bytes16 qs, lo, hi;
        std::memcpy(&qs, b + (type == Q4_0 ? 2 : 4), 16);
        lo = qs & 0xF;
        hi = qs >> 4;
        std::memcpy(q, &lo, 16);
        std::memcpy(q + 16, &hi, 16);
        const float scale = half_at(b);
        d[0] = d[1] = scale;
        m[0] = m[1] = type == Q4_0 ? -8.f * scale : half_at(b + 2);
        q += 32, d += 2, m += 2;
        break;
      }
      case Q5_0:
      case Q5_1: {  // d (, m), 32 high bits qh (bit i tops input i), then Q4_0's 16 bytes of nibbles
        bytes16 qs, lo, hi;
        const int64_t at_qh = type == Q5_0 ? 2 : 4;
        std::memcpy(&qs, b + at_qh + 4, 16);
        uint32_t qh;
        std::memcpy(&qh, b + at_qh, 4);
        lo = qs & 0xF;
        hi = qs >> 4;
        std::memcpy(q, &lo, 16);
        std::memcpy(q + 16, &hi, 16);
        for (int i = 0; i < 32; ++i) q[i] |= uint8_t(((qh >> i) & 1) << 4);
        const float scale = half_at(b);
        d[0] = d[1] = scale;
        m[0] = m[1] = type == Q5_0 ? -16.f * scale : half_at(b + 2);
        q += 32, d += 2, m += 2;
        break;
      }
      case Q4_K:
      case Q5_K: {
        const float dd = half_at(b), dmin = half_at(b + 2);
        const uint8_t* scales = b + 4;
        const uint8_t* qh = b + 16;                         // Q5_K: bit j of qh[l] tops value l of sub-block j
        const uint8_t* qs = b + (type == Q4_K ? 16 : 48);  // sub-blocks 2i, 2i+1: low, high nibbles of 32 bytes
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min_k4(j, scales, sc, mn);
          bytes32 v, high;
          std::memcpy(&v, qs + (j / 2) * 32, 32);
          v = (v >> ((j % 2) * 4)) & 0xF;
          if (type == Q5_K) {
            std::memcpy(&high, qh, 32);
            v |= ((high >> j) & 1) << 4;
          }
          std::memcpy(q, &v, 32);
          d[0] = d[1] = dd * float(sc);
          m[0] = m[1] = -dmin * float(mn);
          q += 32, d += 2, m += 2;
        }
        break;
      }
      default: {  // Q6_K: ql[128] (low nibbles), qh[64] (2 high bits), int8 scales[16], d
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
        const float dd = half_at(b + 208);
        // Input 32s + l of a half (s = 0..3): nibble s / 2 of ql[32 (s % 2) + l], bits 2s of qh[l].
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32)
          for (int s = 0; s < 4; ++s) {
            bytes32 low, high;
            std::memcpy(&low, ql + 32 * (s % 2), 32);
            std::memcpy(&high, qh, 32);
            const bytes32 v = ((low >> (4 * (s / 2))) & 0xF) | (((high >> (2 * s)) & 3) << 4);
            std::memcpy(q + half * 128 + 32 * s, &v, 32);
          }
        for (int j = 0; j < 16; ++j) {
          d[j] = dd * float(scales[j]);
          m[j] = -32.f * d[j];
        }
        q += 256, d += 16, m += 16;
        break;
      }
    }
  }
}

inline void decode_row(int64_t type, const uint8_t* row, int64_t first_block, int64_t blocks, uint8_t* q, float* d,
                       float* m) {
  switch (type) {
    case Q8_0: return decode_blocks<Q8_0>(row, first_block, blocks, q, d, m);
    case Q4_0: return decode_blocks<Q4_0>(row, first_block, blocks, q, d, m);
    case Q4_1: return decode_blocks<Q4_1>(row, first_block, blocks, q, d, m);
    case Q5_0: return decode_blocks<Q5_0>(row, first_block, blocks, q, d, m);
    case Q5_1: return decode_blocks<Q5_1>(row, first_block, blocks, q, d, m);
    case Q4_K: return decode_blocks<Q4_K>(row, first_block, blocks, q, d, m);
    case Q5_K: return decode_blocks<Q5_K>(row, first_block, blocks, q, d, m);
    default: return decode_blocks<Q6_K>(row, first_block, blocks, q, d, m);
  }
}

}  // namespace tiergate_quant
