// quant_gemv_body.h's few-row kernels on AVX2 with maddubs (quant_gemv_avx2.h's traits).

#include "quant_packed.h"

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace tiergate_quant {
namespace {

// Never called here (VNNI is false); declared so the traits compile without AVX-VNNI.
inline __m256i dpbusd(__m256i acc, __m256i, __m256i) { return acc; }

#include "quant_gemv_avx2.h"

using V = Avx2<false>;
#include "quant_gemv_body.h"

}  // namespace

void gemv_groups_avx2(const GemvJob& job, int64_t g0, int64_t g1) { gemv_body::groups(job, g0, g1); }

}  // namespace tiergate_quant

#pragma GCC pop_options
