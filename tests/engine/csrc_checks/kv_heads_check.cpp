// Built by tests/engine/test_simd_lanes.py for the AVX-512 and the AVX2 width: kv_heads.h's Q8_0 reads
// (a vector at a time, a group widened at once) against each value read alone, and max_lanes against a
// scalar max. Exits non-zero on a mismatch.
#include "kv_heads.h"

#include <cstdio>
#include <cstdlib>

using namespace tiergate_simd;

int main() {
  std::srand(2);
  int bad = 0;
  constexpr int64_t head_dim = 128;
  float x[head_dim], widened[head_dim];
  uint8_t head[tiergate_kv::Q8_BYTES * head_dim / tiergate_kv::Q8_GROUP];
  for (int trial = 0; trial < 200; ++trial) {
    for (float& value : x) value = static_cast<float>(std::rand() % 2001 - 1000) / (1 + trial % 13);
    tiergate_kv::quantize_q8_0_head(x, head_dim, head);
    for (int64_t g = 0; g < head_dim / tiergate_kv::Q8_GROUP; ++g)
      tiergate_kv::widen_q8_0_group(head + g * tiergate_kv::Q8_BYTES, widened + g * tiergate_kv::Q8_GROUP);
    for (int64_t j = 0; j < head_dim / LANES; ++j) {
      const lanes v = tiergate_kv::load_q8_0(head, j);
      for (int64_t l = 0; l < LANES; ++l) {
        const float one = tiergate_kv::q8_0_at(head, j * LANES + l);
        bad += v[l] != one || widened[j * LANES + l] != one;
      }
    }
    lanes v;
    for (int64_t l = 0; l < LANES; ++l) v[l] = x[(trial + l) % head_dim];
    float expected = v[0];
    for (int64_t l = 1; l < LANES; ++l) expected = std::max(expected, v[l]);
    bad += max_lanes(v) != expected;
  }
  std::printf("lanes %ld, mismatches %d\n", static_cast<long>(LANES), bad);
  return bad != 0;
}
