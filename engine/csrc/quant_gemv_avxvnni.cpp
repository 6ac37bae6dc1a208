// quant_gemv_body.h's few-row kernels on AVX2 with AVX-VNNI (quant_gemv_avx2.h's traits).

#include "quant_packed.h"

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#include <immintrin.h>

namespace tiergate_quant {
namespace {

inline __m256i dpbusd(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }

#include "quant_gemv_avx2.h"

using V = Avx2<true>;
#include "quant_gemv_body.h"

}  // namespace

void gemv_groups_avxvnni(const GemvJob& job, int64_t g0, int64_t g1) { gemv_body::groups(job, g0, g1); }

}  // namespace tiergate_quant

#pragma GCC pop_options
