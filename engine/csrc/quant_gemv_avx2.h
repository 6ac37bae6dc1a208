// The AVX2 vector traits of quant_gemv_body.h: a ymm holds 8 rows, two passes per group of 16.
// With AVX-VNNI the 4-input sums are one vpdpbusd; without, maddubs (pairs to int16, which
// cannot overflow here: weights of at most 6 bits, or |w| <= 128 with x's sign moved onto it)
// then madd by ones (pairs to int32). Included under a target pragma by quant_gemv_avx2.cpp
// (AVX2 alone) and quant_gemv_avxvnni.cpp: one TU per instruction set, so a compiler fusing
// madd and add into AVX-VNNI's vpdpwssd cannot put it in the AVX2 path.
// No include guard: each TU includes it once, inside its own namespace.

template <bool VNNI>
struct Avx2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int LANES = 8, SLICES = 2, BYTES = 32;
  static constexpr int S8_OFFSET = VNNI ? 128 : 0;
  // Without VNNI a product of 4 bytes takes maddubs (pairs to int16), madd (to int32) and an add: the
  // pairs of several words are added as int16 first (exact while they fit: gemv_body's pair_sums), then
  // widened once.
  static constexpr bool PAIR_SUMS = !VNNI;
  static I mul_pairs(I u, I x) { return _mm256_maddubs_epi16(u, x); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen_pairs(I p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set1_8(char v) { return _mm256_set1_epi8(v); }
  static I set1_32(int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I srli32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I slli32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srai32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I dot(I acc, I u, I x) {
    if constexpr (VNNI) return dpbusd(acc, u, x);
    else return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
  static I dot_at(I acc, I u, const int32_t* x) { return dot(acc, u, set1_32(*x)); }
  static I dot_s8(I acc, I w, I x) {
    if constexpr (VNNI) return dpbusd(acc, _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))), x);
    else return dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
  static I dot_s8_at(I acc, I w, const int32_t* x) { return dot_s8(acc, w, set1_32(*x)); }
  static F zero_ps() { return _mm256_setzero_ps(); }
  static F set1_ps(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* out, F v, int64_t count) {
    if (count >= 8) return _mm256_storeu_ps(out, v);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::copy_n(lanes, count, out);
  }
};

