// quant_gemv_body.h's packed kernels in plain C++, for CPUs without AVX2: a "vector" is one int
// (one row's 4 bytes of a piece) or one float, so a group takes 16 passes of one row. The integer
// sums are the vector paths' exactly (no saturation: the body's operands never reach it).

#include "quant_packed.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tiergate_quant {
namespace {

struct V {
  using I = int32_t;
  using F = float;
  static constexpr int LANES = 1, SLICES = 16, BYTES = 4;
  static constexpr bool PAIR_SUMS = false;  // quant_gemv_avx2.h's
  static constexpr int S8_OFFSET = 0;  // dot_s8 multiplies signed by signed: no offset to take back
  static I load(const uint8_t* p) {
    I v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static I zero() { return 0; }
  static I set1_8(char v) { return I(0x01010101u * uint8_t(v)); }
  static I set1_32(int32_t v) { return v; }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I add32(I a, I b) { return I(uint32_t(a) + uint32_t(b)); }
  static I srli16(I a, int n) {  // each 16-bit half shifted on its own, as vpsrlw does
    const uint32_t u = uint32_t(a);
    return I(((u & 0xFFFFu) >> n) | (((u >> 16) >> n) << 16));
  }
  static I srli32(I a, int n) { return I(uint32_t(a) >> n); }
  static I slli32(I a, int n) { return I(uint32_t(a) << n); }
  static I srai32(I a, int n) { return a >> n; }
  template <bool SIGNED>
  static I dot4(I acc, I w, I x) {
    for (int k = 0; k < 4; ++k) {
      const int32_t wk = SIGNED ? int32_t(int8_t(uint32_t(w) >> 8 * k)) : int32_t(uint8_t(uint32_t(w) >> 8 * k));
      acc += wk * int32_t(int8_t(uint32_t(x) >> 8 * k));
    }
    return acc;
  }
  static I dot(I acc, I u, I x) { return dot4<false>(acc, u, x); }
  static I dot_at(I acc, I u, const int32_t* x) { return dot(acc, u, set1_32(*x)); }
  static I dot_s8(I acc, I w, I x) { return dot4<true>(acc, w, x); }
  static I dot_s8_at(I acc, I w, const int32_t* x) { return dot_s8(acc, w, set1_32(*x)); }
  static F zero_ps() { return 0.f; }
  static F set1_ps(float v) { return v; }
  static F cvt(I a) { return float(a); }
  static F mul(F a, F b) { return a * b; }
  // One rounding, as the vector paths' fused multiply-adds: `a * b + c` left it to the compiler's
  // contraction, which changed with the code around it.
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
  static F fnmadd(F a, F b, F c) { return std::fma(-a, b, c); }
  static F halves(const uint8_t* p) { return half_at(p); }
  static void store(float* out, F v, int64_t) { *out = v; }
};

#include "quant_gemv_body.h"

}  // namespace

void gemv_groups_scalar(const GemvJob& job, int64_t g0, int64_t g1) { gemv_body::groups(job, g0, g1); }

}  // namespace tiergate_quant
