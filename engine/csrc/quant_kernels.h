// What the quantized kernels' translation units share: the kernel paths, the quantized activations,
// the entry of the AVX-512 path that decodes weights in registers (quant_fused_avx512.cpp) and the
// blocks' check (quant_blocks.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace at {
class Tensor;
}

namespace tiergate_quant {

// The kernel paths, as engine/quant_linear.py numbers them (TIERGATE_QUANT_ISA).
enum Isa : int64_t { AVX512 = 0, AVX2 = 1, SCALAR = 2, AVXVNNI = 3 };

// Whether this CPU runs kernel path `isa` (quant_blocks.cpp).
bool isa_supported(int64_t isa);

constexpr int64_t STEP = 64;  // inputs are padded to a multiple: one AVX-512 vector of int8

// COUNT (16 or 32) activations to int8 with one scale d = max|x| / 127, rounded half away from zero
// as ggml's reference Q8 quantizer rounds (std::round is a libm call per value; trunc and a compare
// vectorize), clamped for a rounding at 127; sums[h] gets the sum of values 16h..16h+15.
template <int COUNT>
inline float quantize_block(const float* src, int8_t* q, int* sums) {
  float amax = 0.f;
  for (int i = 0; i < COUNT; ++i) amax = std::max(amax, std::fabs(src[i]));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < COUNT / 16; ++h) sums[h] = 0;
  for (int i = 0; i < COUNT; ++i) {
    const float v = src[i] * id, t = std::trunc(v);
    const float r = t + (std::fabs(v - t) >= 0.5f ? std::copysign(1.f, v) : 0.f);
    const int n = int(std::clamp(r, -127.f, 127.f));
    q[i] = int8_t(n);
    sums[i / 16] += n;
  }
  return d;
}

// Activations quantized per row: int8 values in blocks of 32, each block's scale d, and per 16
// inputs d and d times the sum of the block's int8 values (which the formats' offsets multiply).
struct Acts {
  std::vector<int8_t> q;      // [rows, in_pad]
  std::vector<float> d;       // [rows, in_pad / 16]
  std::vector<float> s;       // [rows, in_pad / 16]
  std::vector<float> lanes;   // [rows, in_pad / 4]: d once per 4 inputs, as an int32 lane of dot products sums them
  int64_t in_pad = 0;
};

// Outputs [first, first + count) of one weight (`blocks`, ggml rows of `row_bytes`) for `rows`
// (<= FUSED_MAX_ROWS) rows of `acts` from `row0`, written to out[r * out_stride + col].
struct FusedArgs {
  const uint8_t* blocks;
  int64_t type, row_bytes, in, first, count;
  const Acts* acts;
  int64_t row0, rows;
  float* out;  // at (row0, the part's column of `first`)
  int64_t out_stride;
};

constexpr int FUSED_MAX_ROWS = 4;

// Whether the AVX-512 VNNI path served these outputs by decoding each weight chunk in registers
// (true), or leaves them to the decode-to-scratch tiles (false: a format it does not decode).
bool fused_avx512(const FusedArgs& a);

// One weight row decoded as quant_formats.h's decode_row does, with AVX-512; false where it
// leaves that to decode_row (Q8_0, whose bytes are copied, or rows of an odd number of 32-input blocks).
bool decode_avx512(int64_t type, const uint8_t* row, int64_t in, uint8_t* q, float* d16, float* m16);

// Raises unless `blocks` holds `out_features` rows of format `type` over `in` inputs, as a contiguous
// uint8 CPU tensor of ggml rows [out, bytes] or of quant_packed.h's groups [groups, blocks, tile bytes];
// `op` names the operator in the message (quant_blocks.cpp).
void check_blocks(const char* op, const at::Tensor& blocks, int64_t type, int64_t in, int64_t out_features);

}  // namespace tiergate_quant
