// Projections whose weights stay in GGUF block formats: y = x @ W with W as the file stores it.
//
// Registered as torch.ops.tiergate.quant_linear (float32 x, any number of weights side by side,
// each in its own format; the formats' check and dequantizer are quant_blocks.cpp's). As
// llama.cpp does, each row of x is quantized once per call to int8 in blocks of 32 with a float
// scale (and per 16 inputs the scaled sum of its int8 values, which the formats' offsets multiply), and the dot
// products run on integers: a weight block and an activation block give an int32 dot, scaled to
// float once per 16 inputs. Sums of 4 products are one int32 lane in every path (VNNI's dpbusd,
// AVX2's maddubs then madd), so the scales of 16 inputs cover 4 lanes.
//
// Threads split the outputs in groups of GROUP; a group's rows are decoded once
// (quant_formats.h) into bytes and float scales in a thread's scratch, which stays in L2, and
// every row of x then passes over them in tiles of ROWS x OUTS sums kept in registers. A decode
// step (one row) thus reads each weight byte once from memory, and a prefill chunk decodes each
// weight once for all its rows.
//
// The paths are compiled with target attributes so one build holds all of them, and the
// caller picks one per call (engine/quant_linear.py: the best the CPU runs, or the one forced
// by TIERGATE_QUANT_ISA): 0 AVX-512 VNNI, 1 AVX2, 2 scalar, 3 AVX2 with AVX-VNNI (whose tiles
// here are AVX2's).
//
// A weight may come repacked (quant_packed.h: a 3-d tensor): the call's packed weights go to
// quant_gemv.cpp's kernels, which read that layout in place at every row count; only the weights
// in the file's layout are decoded into scratch as above.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include "quant_formats.h"
#include "quant_kernels.h"
#include "quant_packed.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>


namespace {

using namespace tiergate_quant;

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t GROUP = 16;  // outputs a thread decodes at once

// A tile's operands: ROWS rows of x from `x`, OUTS decoded weight rows from `w`.
struct Tile {
  const uint8_t* w;
  const float* wd;
  const float* wm;
  const int8_t* x;
  const float* xd;
  const float* xs;
  int64_t in_pad;
  float* out;
  int64_t out_stride;
  int64_t outs;  // how many of the OUTS results to store (the rest are padding)
};

Acts quantize_acts(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1), stride = x.stride(0);
  Acts a;
  a.in_pad = (in + STEP - 1) / STEP * STEP;
  const int64_t n16 = a.in_pad / 16;
  a.q.assign(rows * a.in_pad, 0);
  a.d.assign(rows * n16, 0.f);
  a.s.assign(rows * n16, 0.f);
  a.lanes.assign(rows * a.in_pad / 4, 0.f);
  const float* xp = x.const_data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = xp + r * stride;
      int8_t* q = a.q.data() + r * a.in_pad;
      for (int64_t b = 0; b < in / 32; ++b) {
        int sums[2];
        const float d = quantize_block<32>(src + b * 32, q + b * 32, sums);
        for (int h = 0; h < 2; ++h) {
          a.d[r * n16 + b * 2 + h] = d;
          a.s[r * n16 + b * 2 + h] = d * float(sums[h]);
        }
        std::fill_n(a.lanes.data() + r * a.in_pad / 4 + b * 8, 8, d);
      }
    }
  });
  return a;
}

// ---- scalar path ----

template <int ROWS, int OUTS, bool SIGNED>
void tile_scalar(const Tile& t) {
  const int64_t n16 = t.in_pad / 16;
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < t.outs; ++o) {
      const uint8_t* w = t.w + o * t.in_pad;
      const int8_t* x = t.x + r * t.in_pad;
      float sum = 0.f;
      for (int64_t j = 0; j < n16; ++j) {
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) {
          const int32_t wv = SIGNED ? int32_t(int8_t(w[j * 16 + i])) : int32_t(w[j * 16 + i]);
          dot += wv * int32_t(x[j * 16 + i]);
        }
        sum += float(dot) * (t.xd[r * n16 + j] * t.wd[o * n16 + j]);
        if (!SIGNED) sum += t.wm[o * n16 + j] * t.xs[r * n16 + j];
      }
      t.out[r * t.out_stride + o] = sum;
    }
}

// Sum over the 16-input blocks of the weight's offsets times the activations' scaled sums.
inline float offsets_scalar(const Tile& t, int r, int o, int64_t from) {
  const int64_t n16 = t.in_pad / 16;
  float sum = 0.f;
  for (int64_t j = from; j < n16; ++j) sum += t.wm[o * n16 + j] * t.xs[r * n16 + j];
  return sum;
}

// ---- AVX-512 VNNI path ----

TARGET_AVX512 inline __m512 expand4_avx512(const float* p) {
  // 4 scales of 16 inputs each onto the 16 lanes of 64 inputs (lane l sums inputs 4l..4l+3).
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(p)));
}

template <int ROWS, int OUTS, bool SIGNED>
TARGET_AVX512 void tile_avx512(const Tile& t) {
  const int64_t n16 = t.in_pad / 16;
  __m512 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < t.in_pad; k += 64) {
    __m512i w[OUTS];
    __m512 wd[OUTS];
    __mmask64 negative[OUTS];
    for (int o = 0; o < OUTS; ++o) {
      w[o] = _mm512_loadu_si512(t.w + o * t.in_pad + k);
      wd[o] = expand4_avx512(t.wd + o * n16 + k / 16);
      if (SIGNED) {  // dpbusd takes u8 x s8: |w| times x with w's sign
        negative[o] = _mm512_movepi8_mask(w[o]);
        w[o] = _mm512_abs_epi8(w[o]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512i x = _mm512_loadu_si512(t.x + r * t.in_pad + k);
      const __m512 xd = expand4_avx512(t.xd + r * n16 + k / 16);
      for (int o = 0; o < OUTS; ++o) {
        const __m512i xs = SIGNED ? _mm512_mask_sub_epi8(x, negative[o], zero, x) : x;
        const __m512i dot = _mm512_dpbusd_epi32(zero, w[o], xs);
        acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(xd, wd[o]), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < t.outs; ++o) {
      __m512 sum = acc[r][o];
      int64_t j = 0;
      if (!SIGNED) {
        for (; j + 16 <= n16; j += 16)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(t.wm + o * n16 + j), _mm512_loadu_ps(t.xs + r * n16 + j), sum);
      }
      t.out[r * t.out_stride + o] =
          _mm512_reduce_add_ps(sum) + (SIGNED ? 0.f : offsets_scalar(t, r, o, j));
    }
}

// ---- AVX2 path ----

TARGET_AVX2 inline __m256 expand2_avx2(const float* p) {
  const __m256i idx = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64(
                                      reinterpret_cast<const __m128i*>(p)))),
                                  idx);
}

TARGET_AVX2 inline float sum_avx2(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <int ROWS, int OUTS, bool SIGNED>
TARGET_AVX2 void tile_avx2(const Tile& t) {
  const int64_t n16 = t.in_pad / 16;
  __m256 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < t.in_pad; k += 32) {
    __m256i w[OUTS], sign_of[OUTS];
    __m256 wd[OUTS];
    for (int o = 0; o < OUTS; ++o) {
      sign_of[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + o * t.in_pad + k));
      // maddubs takes u8 x s8: |w| times x with w's sign. Pairs stay under 2^15: |w| <= 128 and
      // |x| <= 127 signed, w <= 63 unsigned.
      w[o] = SIGNED ? _mm256_sign_epi8(sign_of[o], sign_of[o]) : sign_of[o];
      wd[o] = expand2_avx2(t.wd + o * n16 + k / 16);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.x + r * t.in_pad + k));
      const __m256 xd = expand2_avx2(t.xd + r * n16 + k / 16);
      for (int o = 0; o < OUTS; ++o) {
        const __m256i xs = SIGNED ? _mm256_sign_epi8(x, sign_of[o]) : x;
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w[o], xs), ones);
        acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xd, wd[o]), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < t.outs; ++o) {
      __m256 sum = acc[r][o];
      int64_t j = 0;
      if (!SIGNED) {
        for (; j + 8 <= n16; j += 8)
          sum = _mm256_fmadd_ps(_mm256_loadu_ps(t.wm + o * n16 + j), _mm256_loadu_ps(t.xs + r * n16 + j), sum);
      }
      t.out[r * t.out_stride + o] = sum_avx2(sum) + (SIGNED ? 0.f : offsets_scalar(t, r, o, j));
    }
}

// ---- dispatch ----

using TileFn = void (*)(const Tile&);

template <int ROWS, int OUTS>
TileFn pick_tile(int64_t isa, bool is_signed) {
  if (isa == AVX512) return is_signed ? tile_avx512<ROWS, OUTS, true> : tile_avx512<ROWS, OUTS, false>;
  if (isa == AVX2) return is_signed ? tile_avx2<ROWS, OUTS, true> : tile_avx2<ROWS, OUTS, false>;
  return is_signed ? tile_scalar<ROWS, OUTS, true> : tile_scalar<ROWS, OUTS, false>;
}

// Each path's tile: the sums of ROWS x OUTS in registers (32 vector registers with AVX-512, 16 with AVX2).
constexpr int MAX_ROWS = 4;
constexpr int OUTS = 4;

struct Kernels {
  TileFn by_rows[MAX_ROWS + 1];  // [rows in the tile]
};

template <int... R>
Kernels kernels_for(int64_t isa, bool is_signed, std::integer_sequence<int, R...>) {
  return Kernels{{nullptr, pick_tile<R + 1, OUTS>(isa, is_signed)...}};
}

struct Part {
  const uint8_t* blocks;  // ggml rows
  int64_t type, out_features, row_bytes, col0;
};

struct Group {
  int64_t part, first;  // outputs [first, first + GROUP) of the part (fewer at its end)
};


}  // namespace

namespace tiergate_quant {

at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                        at::IntArrayRef out_features, int64_t isa, bool row_prefetch) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be a float32 CPU tensor [rows, in] with contiguous rows");
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size() && blocks.size() == out_features.size(),
              "quant_linear: one type and one out_features per weight");
  TORCH_CHECK(isa_supported(isa), "quant_linear: this CPU cannot run kernel path ", isa);
  const int64_t rows = x.size(0), in = x.size(1);
  std::vector<Part> parts;      // in the file's layout: the scratch tiles below
  std::vector<GemvPart> packed;  // repacked: quant_gemv.cpp's kernels
  std::vector<Group> groups;
  int64_t total = 0;
  for (size_t p = 0; p < blocks.size(); ++p) {
    check_blocks("quant_linear", blocks[p], types[p], in, out_features[p]);
    const uint8_t* data = blocks[p].const_data_ptr<uint8_t>();
    if (blocks[p].dim() == 3) {
      packed.push_back({data, types[p], out_features[p], total});
    } else {
      for (int64_t first = 0; first < out_features[p]; first += GROUP) groups.push_back({int64_t(parts.size()), first});
      parts.push_back({data, types[p], out_features[p], row_bytes_of(types[p], in), total});
    }
    total += out_features[p];
  }
  at::Tensor out = at::empty({rows, total}, x.options());
  if (rows == 0) return out;
  float* outp = out.mutable_data_ptr<float>();
  if (!packed.empty())
    gemv_packed(x.const_data_ptr<float>(), x.stride(0), rows, in, packed.data(), int(packed.size()), isa, row_prefetch,
                outp, total);
  if (groups.empty()) return out;
  if (isa == AVXVNNI) isa = AVX2;  // the scratch tiles' AVX2 path: maddubs serves them as well
  const Acts a = quantize_acts(x);
  const int64_t n16 = a.in_pad / 16;
  const Kernels unsigned_tiles = kernels_for(isa, false, std::make_integer_sequence<int, MAX_ROWS>{});
  const Kernels signed_tiles = kernels_for(isa, true, std::make_integer_sequence<int, MAX_ROWS>{});
  // A few rows: AVX-512 decodes each weight chunk in registers for all of them (quant_fused_avx512.cpp).
  const bool fused = isa == AVX512 && rows <= FUSED_MAX_ROWS;

  at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t begin, int64_t end) {
    // Zeroed once: the padding past `in` stays zero and weighs nothing; outputs past a part's
    // end compute on stale finite values and are not stored.
    // Allocated on first use: the fused path needs none.
    std::vector<uint8_t> q;
    std::vector<float> d, m;
    for (int64_t g = begin; g < end; ++g) {
      const Part& part = parts[groups[g].part];
      const int64_t first = groups[g].first, count = std::min(GROUP, part.out_features - first);
      const uint8_t* group_rows = part.blocks + first * part.row_bytes;
      if (fused) {
        const FusedArgs f{group_rows, part.type, part.row_bytes, in, 0, count, &a, 0, rows,
                          outp + part.col0 + first, total};
        if (fused_avx512(f)) continue;
      }
      if (q.empty()) {
        q.assign(GROUP * a.in_pad, 0);
        d.assign(GROUP * n16, 0.f);
        m.assign(GROUP * n16, 0.f);
      }
      const int64_t nblocks = in / format_of(part.type).block_values;
      for (int64_t o = 0; o < count; ++o) {
        const uint8_t* row = group_rows + o * part.row_bytes;
        uint8_t* qo = q.data() + o * a.in_pad;
        float *d_o = d.data() + o * n16, *m_o = m.data() + o * n16;
        if (!(isa == AVX512 && decode_avx512(part.type, row, in, qo, d_o, m_o)))
          decode_row(part.type, row, 0, nblocks, qo, d_o, m_o);
      }
      const Kernels& tiles = part.type == Q8_0 ? signed_tiles : unsigned_tiles;
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t tile_rows = std::min<int64_t>(MAX_ROWS, rows - r0);
        for (int64_t o0 = 0; o0 < count; o0 += OUTS) {
          const Tile t{q.data() + o0 * a.in_pad, d.data() + o0 * n16, m.data() + o0 * n16,
                       a.q.data() + r0 * a.in_pad, a.d.data() + r0 * n16, a.s.data() + r0 * n16,
                       a.in_pad, outp + r0 * total + part.col0 + first + o0, total,
                       std::min<int64_t>(OUTS, count - o0)};
          tiles.by_rows[tile_rows](t);
        }
      }
    }
  });
  return out;
}

}  // namespace tiergate_quant

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("quant_linear(Tensor x, Tensor[] blocks, int[] types, int[] out_features, int isa, bool row_prefetch) "
        "-> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(tiergate_quant::quant_linear));
}
