// Many-row products with GGUF block-format weights on AMX: each panel of output rows is decoded
// to bfloat16 and multiplied by oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm),
// which runs on the AMX tiles with float32 sums.
//
// Registered as torch.ops.tiergate.quant_panel_linear (float32 x, weights side by side as
// quant_linear takes them), quant_dequantize_bf16 (a weight's rows decoded as the panels are, for
// the tests) and quant_panel_supported. Used by engine/quant_linear.py for calls with many rows
// of x, where the int8 tiles of quant_linear.cpp are bound by their integer dot products and the
// tiles' throughput wins; a decode step (few rows) stays on quant_linear's path, which reads the
// file's bytes once at memory speed.
//
// Why oneDNN's micro-kernel and not our own tiles: it is kept by Intel, picks AMX or AVX-512 per
// CPU, and its kernels are JIT-built and cached by shape; we keep only the decode and the blocking.
// Why not torch.mm on a dequantized copy: its bfloat16 product rounds the output to bfloat16, and
// a whole-weight copy per call would leave the caches.
//
// The weight is the A operand (rows of the panel, as the file stores them: no transposition of
// the decoded values), x the B operand, packed once per call into oneDNN's VNNI layout in column
// blocks of XCOLS rows of x. A thread decodes one panel of PANEL outputs into its scratch
// (PANEL x in bfloat16: 256 KB for an input of 2048, within L2), multiplies it by every block of
// x, and writes the float32 results transposed into the output.
//
// Values: each weight is decoded exactly in float32 (as quant_dequantize gives it, ggml's
// rounding) and rounded once to bfloat16 (to nearest, ties to even); x is rounded once to
// bfloat16. bfloat16 keeps 8 significant bits, so a weight of Q8_0 (an int8 times a half scale)
// or of a K format with its offset may move by up to 2^-8 of its size: the engine's quality test
// (tests/engine/test_gguf_native_quality.py) measures the effect on the logits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "quant_formats.h"
#include "quant_kernels.h"
#include "quant_packed.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace tiergate_quant;

constexpr int64_t PANEL = 64;  // outputs a thread decodes at once
constexpr int64_t XCOLS = 64;  // rows of x per packed block: the widest B operand oneDNN's packing takes

#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

bool has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// One decoded row (quant_formats.h's q, d, m) as bfloat16 values: d * q + m (Q6_K: d * (q - 32), as ggml
// rounds it) in float32, then rounded once.
template <bool SIGNED, bool Q6K>
void to_bf16_scalar(const uint8_t* q, const float* d, const float* m, int64_t in, c10::BFloat16* dst) {
  for (int64_t i = 0; i < in; ++i) {
    const float v = Q6K ? d[i / 16] * float(int(q[i]) - 32)
                        : d[i / 16] * (SIGNED ? float(int8_t(q[i])) : float(q[i])) + m[i / 16];
    dst[i] = c10::BFloat16(v);  // rounds to nearest even, as vcvtneps2bf16 does
  }
}

template <bool SIGNED, bool Q6K>
TARGET_BF16 void to_bf16_avx512(const uint8_t* q, const float* d, const float* m, int64_t in, c10::BFloat16* dst) {
  const __m512i offset = _mm512_set1_epi32(32);
  for (int64_t i = 0; i < in; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    __m512i n = SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    if (Q6K) n = _mm512_sub_epi32(n, offset);
    const __m512 scale = _mm512_set1_ps(d[i / 16]);
    // d * q is exact in float32 (quant_formats.h), so the fused form rounds as d * q + m does.
    const __m512 v = Q6K ? _mm512_mul_ps(scale, _mm512_cvtepi32_ps(n))
                         : _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(n), _mm512_set1_ps(m[i / 16]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

using ToBf16 = void (*)(const uint8_t*, const float*, const float*, int64_t, c10::BFloat16*);

ToBf16 pick_to_bf16(int64_t type, bool vector) {
  if (vector) {
    if (type == Q8_0) return to_bf16_avx512<true, false>;
    return type == Q6_K ? to_bf16_avx512<false, true> : to_bf16_avx512<false, false>;
  }
  if (type == Q8_0) return to_bf16_scalar<true, false>;
  return type == Q6_K ? to_bf16_scalar<false, true> : to_bf16_scalar<false, false>;
}

// Decodes `count` rows from `row0` of a weight into dst [count, in] bfloat16; q, d, m: scratch of in, in / 16, in / 16.
// A weight repacked for the decode kernels (quant_packed.h: `packed`) has each group of 16 rows unpacked into
// `group_rows` (16 ggml rows) first.
void decode_panel(int64_t type, const uint8_t* blocks, bool packed, int64_t row_bytes, int64_t in, int64_t row0,
                  int64_t count, ToBf16 to_bf16, uint8_t* q, float* d, float* m, uint8_t* group_rows,
                  c10::BFloat16* dst) {
  const int64_t nblocks = in / format_of(type).block_values;
  int64_t unpacked = -1;
  for (int64_t o = 0; o < count; ++o) {
    const int64_t row = row0 + o;
    const uint8_t* src = blocks + row * row_bytes;
    if (packed) {
      if (row / PACK_ROWS != unpacked) {
        unpacked = row / PACK_ROWS;
        unpack_group(type, blocks, nblocks, unpacked, group_rows);
      }
      src = group_rows + (row % PACK_ROWS) * row_bytes;
    }
    decode_row(type, src, 0, nblocks, q, d, m);
    to_bf16(q, d, m, in, dst + o * in);
  }
}

bool panel_supported() { return at::native::cpublas::could_pack(at::kBFloat16); }

// x^T in oneDNN's packed layout, one block of `width` rows of x after another (zero rows past the end).
at::Tensor pack_x(const at::Tensor& x, int64_t width) {
  const int64_t rows = x.size(0), in = x.size(1), blocks = (rows + width - 1) / width;
  at::Tensor padded = at::zeros({blocks * width, in}, x.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, rows).copy_(x);  // the one rounding of x to bfloat16
  // [blocks, in, width]: each block's x^T, the K x N operand the packing reads.
  const at::Tensor plain = padded.view({blocks, width, in}).transpose(1, 2).contiguous();
  at::Tensor packed = at::empty_like(plain);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      at::native::cpublas::pack(in, width, width, width, at::kBFloat16, at::kBFloat16,
                                plain.const_data_ptr<c10::BFloat16>() + b * in * width,
                                packed.mutable_data_ptr<c10::BFloat16>() + b * in * width);
  });
  return packed;
}

struct Panel {
  const uint8_t* blocks;
  bool packed;                                  // groups of quant_packed.h, not ggml rows
  int64_t type, row_bytes, first, count, col;  // outputs [first, first + count) of the part, at column col
};

at::Tensor quant_panel_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                              at::IntArrayRef out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quant_panel_linear: x must be a float32 CPU tensor [rows, in]");
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size() && blocks.size() == out_features.size(),
              "quant_panel_linear: one type and one out_features per weight");
  TORCH_CHECK(panel_supported(), "quant_panel_linear: oneDNN's bfloat16 micro-kernel does not run on this CPU");
  const int64_t rows = x.size(0), in = x.size(1);
  std::vector<Panel> panels;
  int64_t total = 0;
  for (size_t p = 0; p < blocks.size(); ++p) {
    check_blocks("quant_panel_linear", blocks[p], types[p], in, out_features[p]);
    for (int64_t first = 0; first < out_features[p]; first += PANEL)
      panels.push_back({blocks[p].const_data_ptr<uint8_t>(), blocks[p].dim() == 3, types[p],
                        row_bytes_of(types[p], in), first, std::min(PANEL, out_features[p] - first), total + first});
    total += out_features[p];
  }
  at::Tensor out = at::empty({rows, total}, x.options());
  if (rows == 0) return out;
  // A block of x as wide as needed and a multiple of 16 (the packing's unit): a few rows pay for no padding.
  const int64_t width = std::min<int64_t>(XCOLS, (rows + 15) / 16 * 16);
  const at::Tensor packed = pack_x(x, width);
  const int64_t xblocks = packed.size(0);
  const c10::BFloat16* xp = packed.const_data_ptr<c10::BFloat16>();
  float* outp = out.mutable_data_ptr<float>();
  const bool vector = has_avx512_bf16();

  at::parallel_for(0, int64_t(panels.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> w(PANEL * in);
    std::vector<uint8_t> q(in);
    std::vector<float> d(in / 16), m(in / 16), c(PANEL * width);
    std::vector<uint8_t> group_rows;
    for (int64_t g = begin; g < end; ++g) {
      const Panel& p = panels[g];
      if (p.packed) group_rows.resize(PACK_ROWS * p.row_bytes);
      decode_panel(p.type, p.blocks, p.packed, p.row_bytes, in, p.first, p.count, pick_to_bf16(p.type, vector),
                   q.data(), d.data(), m.data(), group_rows.data(), w.data());
      for (int64_t b = 0; b < xblocks; ++b) {
        // c [count, width] = panel [count, in] x block b of x^T [in, width]
        at::native::cpublas::brgemm(p.count, width, in, in, width, width, false, w.data(), xp + b * in * width,
                                    c.data(), true);
        const int64_t r0 = b * width, used = std::min(width, rows - r0);
        for (int64_t r = 0; r < used; ++r)
          for (int64_t o = 0; o < p.count; ++o) outp[(r0 + r) * total + p.col + o] = c[o * width + r];
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

// Rows of a weight as the panels hold them: bfloat16 [rows, in].
at::Tensor quant_dequantize_bf16(const at::Tensor& blocks, int64_t type, int64_t in) {
  TORCH_CHECK(blocks.dim() == 2, "quant_dequantize_bf16: ggml rows [out, bytes_per_row] (unpack a packed weight first)");
  check_blocks("quant_dequantize_bf16", blocks, type, in, blocks.size(0));
  const int64_t rows = blocks.size(0);
  at::Tensor out = at::empty({rows, in}, blocks.options().dtype(at::kBFloat16));
  const ToBf16 to_bf16 = pick_to_bf16(type, has_avx512_bf16());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(in);
    std::vector<float> d(in / 16), m(in / 16);
    decode_panel(type, blocks.const_data_ptr<uint8_t>(), false, blocks.size(1), in, begin, end - begin, to_bf16,
                 q.data(), d.data(), m.data(), nullptr, out.mutable_data_ptr<c10::BFloat16>() + begin * in);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("quant_panel_linear(Tensor x, Tensor[] blocks, int[] types, int[] out_features) -> Tensor");
  m.impl("quant_panel_linear", c10::DispatchKey::CPU, TORCH_FN(quant_panel_linear));
  m.def("quant_dequantize_bf16(Tensor blocks, int type, int in_features) -> Tensor");
  m.impl("quant_dequantize_bf16", c10::DispatchKey::CPU, TORCH_FN(quant_dequantize_bf16));
  m.def("quant_panel_supported() -> bool");
  m.impl("quant_panel_supported", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(panel_supported));
}
