// Built by tests/engine/test_simd_lanes.py for the AVX-512 and the AVX2 width of simd_lanes.h:
// sum_each's lanes against each vector's sum in double. Exits non-zero on a mismatch.
#include "simd_lanes.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

using namespace tiergate_simd;

int main() {
  std::srand(1);
  int bad = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    lanes v[LANES];
    for (int i = 0; i < LANES; ++i)
      for (int l = 0; l < LANES; ++l) v[i][l] = static_cast<float>(std::rand() % 2001 - 1000) / 7.f;
    const lanes sums = sum_each(v);
    for (int i = 0; i < LANES; ++i) {
      double expected = 0;
      for (int l = 0; l < LANES; ++l) expected += v[i][l];
      if (std::fabs(sums[i] - expected) > 1e-4 * (1 + std::fabs(expected))) ++bad;
    }
  }
  std::printf("lanes %ld, mismatches %d\n", static_cast<long>(LANES), bad);
  return bad != 0;
}
