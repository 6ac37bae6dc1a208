// quant_gemv_body.h's few-row kernels on AVX-512 VNNI: a zmm holds all 16 rows of a group.

#include "quant_packed.h"

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
#include <immintrin.h>

namespace tiergate_quant {
namespace {

struct V {
  using I = __m512i;
  using F = __m512;
  static constexpr int LANES = 16, SLICES = 1, BYTES = 64;
  // dot_s8 reads the signed weight w as w + 128 (sign bit flipped): the caller's start subtracts 128 sum(x).
  static constexpr bool PAIR_SUMS = false;  // quant_gemv_avx2.h's
  static constexpr int S8_OFFSET = 128;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I set1_8(char v) { return _mm512_set1_epi8(v); }
  static I set1_32(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I srli32(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I slli32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I srai32(I a, int n) { return _mm512_srai_epi32(a, n); }
  // dot with x's word *x broadcast by the instruction's own memory operand ({1to16}): GCC 12 left a separate
  // vpbroadcastd before each vpdpbusd, one more vector instruction per product where the many-row kernels are
  // bound by their instructions, not their bytes.
  static I dot_at(I acc, I u, const int32_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*x));
    return acc;
  }
  static I dot_s8_at(I acc, I w, const int32_t* x) {
    return dot_at(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), x);
  }
  static F zero_ps() { return _mm512_setzero_ps(); }
  static F set1_ps(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* out, F v, int64_t count) { _mm512_mask_storeu_ps(out, __mmask16((1u << count) - 1), v); }
};

#include "quant_gemv_body.h"

}  // namespace

void gemv_groups_avx512(const GemvJob& job, int64_t g0, int64_t g1) { gemv_body::groups(job, g0, g1); }

}  // namespace tiergate_quant

#pragma GCC pop_options
