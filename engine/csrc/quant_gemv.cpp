// The quantized projections over weights repacked at load into quant_packed.h's interleaved
// layout, at every row count, and the ops that pack and unpack that layout.
//
// quant_linear.cpp hands the packed parts of a call to gemv_packed: x is quantized here once
// (int8 per 32 inputs, rounded as quant_linear.cpp's quantize_acts rounds; for a decode step's few
// rows into buffers kept per thread, so it allocates nothing but its output), then the threads
// split the groups of 16 outputs of every part between them and run one instruction set's
// kernels (quant_gemv_body.h) over all the rows.
//
// Registered: torch.ops.tiergate.quant_repack(blocks, type, out) -> out (packed) and
// quant_unpack_rows(packed, type, in_features, ids) -> the ggml rows `ids`, byte for byte.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "quant_kernels.h"
#include "quant_packed.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tiergate_quant {

namespace {

struct GemvActs {
  std::vector<int32_t> q;  // int8 values written through int8_t*, read as words
  std::vector<float> d, ds;
  std::vector<int32_t> s16;
  std::vector<int32_t> wide_q, wide_s16;  // GemvWide's arrays
  std::vector<float> wide_d, wide_ds;
};

// quant_kernels.h's quantize_block on AVX-512 and on AVX2, bit for bit: a decode step's quantizing of x
// took about half the time of its products in scalar code. `count` inputs (16 or 32) share one scale;
// returns it, and each 16's sum of int8 values in sums[0] (and sums[1]).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) float quantize_avx512(const float* src, int8_t* q, int count,
                                                                             int* sums) {
  const __m512 sign_bit = _mm512_set1_ps(-0.f);
  __m512 v[2] = {_mm512_loadu_ps(src), count == 32 ? _mm512_loadu_ps(src + 16) : _mm512_setzero_ps()};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign_bit, v[0]),
                                                        _mm512_andnot_ps(sign_bit, v[1])));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < count / 16; ++h) {
    const __m512 s = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
    const __m512 t = _mm512_roundscale_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    // Half away from zero: one more unit, with s's sign, where |s - t| >= 0.5.
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign_bit, _mm512_sub_ps(s, t)), _mm512_set1_ps(0.5f),
                                            _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.f), _mm512_and_ps(sign_bit, s));
    const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mask_add_ps(t, up, t, one), _mm512_set1_ps(-127.f)),
                                   _mm512_set1_ps(127.f));
    const __m512i n = _mm512_cvttps_epi32(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtsepi32_epi8(n));
    sums[h] = _mm512_reduce_add_epi32(n);
  }
  return d;
}

__attribute__((target("avx2,fma"))) float quantize_avx2(const float* src, int8_t* q, int count, int* sums) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const int vecs = count / 8;
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < vecs; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign_bit, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < count / 16; ++h) {
    __m256i n[2];
    for (int k = 0; k < 2; ++k) {
      const __m256 s = _mm256_mul_ps(v[2 * h + k], _mm256_set1_ps(id));
      const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      // Half away from zero: one more unit, with s's sign, where |s - t| >= 0.5.
      const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, _mm256_sub_ps(s, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
      const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.f), _mm256_and_ps(sign_bit, s));
      const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, _mm256_and_ps(up, one)), _mm256_set1_ps(-127.f)),
                                     _mm256_set1_ps(127.f));
      n[k] = _mm256_cvttps_epi32(r);
    }
    // 16 int32 in [-127, 127] to int8 in order: the packs interleave 128-bit lanes, the permute restores them.
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8);
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), bytes);
    __m256i total = _mm256_add_epi32(n[0], n[1]);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    sums[h] = _mm_cvtsi128_si32(t4);
  }
  return d;
}

// One block of `count` inputs quantized on the job's instruction set.
inline float quantize_on(int64_t isa, const float* src, int8_t* q, int count, int* sums) {
  if (isa == AVX512) return quantize_avx512(src, q, count, sums);
  if (isa == AVX2 || isa == AVXVNNI) return quantize_avx2(src, q, count, sums);
  return count == 32 ? quantize_block<32>(src, q, sums) : quantize_block<16>(src, q, sums);
}

// x's rows to int8, with a scale per 32 inputs, or per 16 (`per16`, quant_packed.h's per16_scales).
void quantize_rows(const float* x, int64_t x_stride, int64_t rows, int64_t in, bool per16, int64_t isa,
                   GemvActs& a) {
  a.q.resize(rows * in / 4);
  a.d.resize(rows * in / (per16 ? 16 : 32));
  a.ds.resize(rows * in / 32);
  a.s16.resize(rows * in / 16);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + r * x_stride;
      int8_t* q = reinterpret_cast<int8_t*>(a.q.data() + r * in / 4);
      for (int64_t b = 0; b < in / 32; ++b) {
        int sums[2];
        const float* from = src + b * 32;
        int8_t* to = q + b * 32;
        if (per16) {
          const float d0 = quantize_on(isa, from, to, 16, sums);
          const float d1 = quantize_on(isa, from + 16, to + 16, 16, sums + 1);
          a.d[r * in / 16 + 2 * b] = d0;
          a.d[r * in / 16 + 2 * b + 1] = d1;
          a.ds[r * in / 32 + b] = d0 * float(sums[0]) + d1 * float(sums[1]);
        } else {
          const float d = quantize_on(isa, from, to, 32, sums);
          a.d[r * in / 32 + b] = d;
          a.ds[r * in / 32 + b] = d * float(sums[0] + sums[1]);
        }
        a.s16[r * in / 16 + 2 * b] = sums[0];
        a.s16[r * in / 16 + 2 * b + 1] = sums[1];
      }
    }
  });
}

// The whole chunks of GEMV_WIDE_ROWS rows of `a` (x scaled per `scaled` inputs, 16 or 32) interleaved as
// GemvWide lays them out.
GemvWide interleave_wide(GemvActs& a, int64_t rows, int64_t in, int64_t scaled) {
  constexpr int64_t W = GEMV_WIDE_ROWS;
  const int64_t chunks = rows / W;
  if (chunks == 0) return {};
  a.wide_q.resize(chunks * W * in / 4);
  a.wide_d.resize(chunks * W * in / scaled);
  a.wide_ds.resize(chunks * W * in / 32);
  a.wide_s16.resize(chunks * W * in / 16);
  const int32_t sums_times = scaled == 32 ? -32 : 1;  // GemvWide::xs16
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = 0; r < W; ++r) {
        const int64_t row = c * W + r;
        for (int64_t i = 0; i < in / 4; ++i) a.wide_q[(c * in / 4 + i) * W + r] = a.q[row * in / 4 + i];
        for (int64_t i = 0; i < in / scaled; ++i) a.wide_d[(c * in / scaled + i) * W + r] = a.d[row * in / scaled + i];
        for (int64_t i = 0; i < in / 16; ++i) a.wide_s16[(c * in / 16 + i) * W + r] = sums_times * a.s16[row * in / 16 + i];
        for (int64_t i = 0; i < in / 32; ++i) a.wide_ds[(c * in / 32 + i) * W + r] = a.ds[row * in / 32 + i];
      }
  });
  return {a.wide_q.data(), a.wide_d.data(), a.wide_ds.data(), a.wide_s16.data()};
}

// Rows up to which a call's activations go to the calling thread's kept buffers: a decode step
// then allocates nothing, and a prefill chunk's megabytes are not held after it.
constexpr int64_t KEPT_ROWS = 16;

}  // namespace

void gemv_packed(const float* x, int64_t x_stride, int64_t rows, int64_t in, const GemvPart* parts, int nparts,
                 int64_t isa, bool row_prefetch, float* out, int64_t out_stride) {
  if (rows < 1) return;
  int64_t groups = 0;
  for (int p = 0; p < nparts; ++p) groups += (parts[p].out_features + PACK_ROWS - 1) / PACK_ROWS;
  bool any16 = false, any32 = false;
  for (int p = 0; p < nparts; ++p) (per16_scales(parts[p].type) ? any16 : any32) = true;
  thread_local GemvActs kept, kept16;  // the caller's thread: reused by every call it makes
  GemvActs local, local16;
  GemvActs& acts = rows <= KEPT_ROWS ? kept : local;
  GemvActs& acts16 = rows <= KEPT_ROWS ? kept16 : local16;
  // x scaled per 32 inputs for the K formats' parts, per 16 for the others; both where the call mixes them.
  quantize_rows(x, x_stride, rows, in, !any32, isa, acts);
  if (any16 && any32) quantize_rows(x, x_stride, rows, in, true, isa, acts16);
  // Only AVX-512's kernels take rows GEMV_WIDE_ROWS at a time.
  const bool wide = isa == AVX512;
  const GemvWide wide16 = wide && any16 && any32 ? interleave_wide(acts16, rows, in, 16) : GemvWide{};
  const GemvWide wide_acts = wide ? interleave_wide(acts, rows, in, any32 ? 32 : 16) : GemvWide{};
  const GemvJob job16{parts, nparts, rows, in, acts16.q.data(), acts16.d.data(), acts16.ds.data(),
                      acts16.s16.data(), out, out_stride, true, nullptr, row_prefetch, wide16};
  const GemvJob job{parts, nparts, rows, in, acts.q.data(), acts.d.data(), acts.ds.data(), acts.s16.data(), out,
                    out_stride, !any32, any16 && any32 ? &job16 : nullptr, row_prefetch, wide_acts};
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    if (isa == AVX512) gemv_groups_avx512(job, g0, g1);
    else if (isa == AVXVNNI) gemv_groups_avxvnni(job, g0, g1);
    else if (isa == AVX2) gemv_groups_avx2(job, g0, g1);
    else gemv_groups_scalar(job, g0, g1);
  });
}

namespace {

int64_t groups_of(int64_t rows) { return (rows + PACK_ROWS - 1) / PACK_ROWS; }

// Into `out` (uint8 [groups, blocks, tile bytes], allocated by the caller: engine/quant_linear.py
// asks for huge pages on it before its pages are first touched here).
at::Tensor quant_repack(const at::Tensor& blocks, int64_t type, const at::Tensor& out) {
  TORCH_CHECK(repacked(type), "quant_repack: no packed layout for block format ", type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % format_of(type).block_bytes == 0,
              "quant_repack: blocks must be a contiguous uint8 CPU tensor [out, whole blocks]");
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1), bb = format_of(type).block_bytes;
  const int64_t nblocks = row_bytes / bb, tb = tile_bytes(type);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == groups_of(rows) && out.size(1) == nblocks && out.size(2) == tb,
              "quant_repack: out must be a contiguous uint8 CPU tensor [groups of 16 rows, blocks, 16 * block bytes]");
  const at::Tensor& packed = out;
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = packed.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, groups_of(rows), 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> zero(bb, 0);  // the rows past the last output
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nblocks; ++b)
        for (int64_t r = 0; r < PACK_ROWS; ++r) {
          const int64_t row = g * PACK_ROWS + r;
          uint8_t* block = row < rows ? const_cast<uint8_t*>(src + row * row_bytes + b * bb) : zero.data();
          move_block(type, dst + (g * nblocks + b) * tb, r, block, true);
        }
  });
  return out;
}

at::Tensor quant_unpack_rows(const at::Tensor& packed, int64_t type, int64_t in, const at::Tensor& ids) {
  TORCH_CHECK(repacked(type), "quant_unpack_rows: no packed layout for block format ", type);
  const Format f = format_of(type);
  TORCH_CHECK(in % f.block_values == 0, "quant_unpack_rows: the input size is not a multiple of ", f.block_values);
  const int64_t nblocks = in / f.block_values, tb = tile_bytes(type);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(1) == nblocks && packed.size(2) == tb,
              "quant_unpack_rows: packed must be a contiguous uint8 CPU tensor [groups, blocks, tile bytes]");
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t n = idx.numel(), limit = packed.size(0) * PACK_ROWS;
  const int64_t* id = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < limit, "quant_unpack_rows: row id out of range");
  at::Tensor rows = at::empty({n, nblocks * f.block_bytes}, packed.options());
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = rows.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = id[i] / PACK_ROWS, r = id[i] % PACK_ROWS;
      for (int64_t b = 0; b < nblocks; ++b)
        move_block(type, const_cast<uint8_t*>(src + (g * nblocks + b) * tb), r,
                   dst + i * nblocks * f.block_bytes + b * f.block_bytes, false);
    }
  });
  return rows;
}

}  // namespace

}  // namespace tiergate_quant

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("quant_repack(Tensor blocks, int type, Tensor(a!) out) -> Tensor(a!)");
  m.impl("quant_repack", c10::DispatchKey::CPU, TORCH_FN(tiergate_quant::quant_repack));
  m.def("quant_unpack_rows(Tensor packed, int type, int in_features, Tensor ids) -> Tensor");
  m.impl("quant_unpack_rows", c10::DispatchKey::CPU, TORCH_FN(tiergate_quant::quant_unpack_rows));
}
