// Causal attention of a prefill chunk on the CPU: query i of the chunk sits at position
// query_offset + i of its keys and attends to keys 0..query_offset + i (with a sliding
// window, only to the last `window` of them). A chunk that starts the prompt passes its
// own keys and offset 0; a later chunk passes its context's keys and values, gathered
// from the cache, followed by its own, and its start as the offset.
//
// Registered as torch.ops.tiergate.prefill_attention, float32, head dims that are a
// multiple of 16 (attention.py sends anything else to SDPA). A work item is one KV head
// and a block of QUERY_BLOCK positions: its query rows (every query head of the KV head's
// group at every position) run a flash-attention pass over blocks of KEY_BLOCK keys with
// an online softmax. Per key block, the keys are transposed once so that a row's 16
// scores come out of one vector FMA per dimension, several rows at a time (ROW_TILE
// sums in registers); the scores are masked, exponentiated 16 at a time and folded into
// each row's running output, which stays in registers while the block's values are
// added. Written by hand because torch's CPU SDPA kernel reached only 50-120 GFLOP/s on
// these shapes, a fraction of what the same cores do in the projections.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "simd_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace tiergate_simd;

constexpr int MAX_VECS = MAX_HEAD_VECS;
constexpr int64_t KEY_BLOCK = LANES;  // a key block's scores fill one vector per row
constexpr int64_t QUERY_BLOCK = 16;
constexpr int ROW_TILE = 8;

struct Chunk {
  const float* q;  // [n, heads, head_dim], row stride q_row
  const float* k;  // [n, kv_heads, head_dim], row stride kv_row
  const float* v;
  float* out;  // [n, heads * head_dim]
  int64_t n, heads, head_dim, group, q_row, kv_row, window, query_offset;
  float scale;
};

// Scores of ROWS query rows (scaled, [rows, head_dim] at `query`) against the transposed
// key block `keys_t` ([head_dim, KEY_BLOCK]) into `scores` ([rows, KEY_BLOCK]).
template <int ROWS>
void score_rows(const float* query, const float* keys_t, int64_t head_dim, float* scores) {
  lanes sums[ROWS] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const lanes key = load(keys_t + d * KEY_BLOCK);
    for (int r = 0; r < ROWS; ++r) sums[r] += query[r * head_dim + d] * key;
  }
  for (int r = 0; r < ROWS; ++r) store(scores + r * KEY_BLOCK, sums[r]);
}

template <int ROWS = ROW_TILE>
void score_tail(int64_t rows, const float* query, const float* keys_t, int64_t head_dim, float* scores) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return score_tail<ROWS - 1>(rows, query, keys_t, head_dim, scores);
  }
  score_rows<ROWS>(query, keys_t, head_dim, scores);
}

// Queries [q_begin, q_end) of the chunk for KV head `kv_head`. Row r of the item is query
// q_begin + r / group (at key position query_offset + q_begin + r / group), query head
// kv_head * group + r % group.
template <int VECS>
void attend_item(const Chunk& c, int64_t kv_head, int64_t q_begin, int64_t q_end, std::vector<float>& scratch) {
  const int64_t dim = VECS * LANES, rows = (q_end - q_begin) * c.group;
  scratch.resize(rows * (2 * dim + KEY_BLOCK + 2) + dim * KEY_BLOCK);
  float* query = scratch.data();           // [rows, dim], scaled
  float* acc = query + rows * dim;         // [rows, dim]
  float* scores = acc + rows * dim;        // [rows, KEY_BLOCK], then their weights
  float* peak = scores + rows * KEY_BLOCK; // [rows]
  float* total = peak + rows;              // [rows]
  float* keys_t = total + rows;            // [dim, KEY_BLOCK]
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = c.q + (q_begin + r / c.group) * c.q_row + (kv_head * c.group + r % c.group) * dim;
    for (int64_t d = 0; d < dim; ++d) query[r * dim + d] = src[d] * c.scale;
    peak[r] = NEG_INF;
    total[r] = 0.f;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  // Keys any row of the item sees: from the first query's window start to the last query.
  const int64_t first_pos = c.query_offset + q_begin, end_key = c.query_offset + q_end;
  const int64_t first_key = c.window > 0 ? std::max<int64_t>(0, first_pos - c.window + 1) : 0;
  lanes lane_index;
  for (int64_t l = 0; l < LANES; ++l) lane_index[l] = static_cast<float>(l);

  for (int64_t k0 = first_key - first_key % KEY_BLOCK; k0 < end_key; k0 += KEY_BLOCK) {
    const int64_t nk = std::min(KEY_BLOCK, end_key - k0);
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t j = 0; j < KEY_BLOCK; ++j)
        keys_t[d * KEY_BLOCK + j] = j < nk ? c.k[(k0 + j) * c.kv_row + kv_head * dim + d] : 0.f;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
      score_tail(std::min<int64_t>(ROW_TILE, rows - r0), query + r0 * dim, keys_t, dim, scores + r0 * KEY_BLOCK);

    for (int64_t r = 0; r < rows; ++r) {
      // Key k0 + j is seen by position `pos` when pos - window < k0 + j <= pos (and j < nk).
      const float pos = static_cast<float>(first_pos + r / c.group - k0);
      const float lowest = c.window > 0 ? pos - static_cast<float>(c.window) : -1.f;
      const int_lanes seen = (lane_index <= lanes{} + pos) & (lane_index > lanes{} + lowest) &
                             (lane_index < lanes{} + static_cast<float>(nk));
      const lanes s = seen ? load(scores + r * KEY_BLOCK) : lanes{} + NEG_INF;
      const float block_peak = std::max(peak[r], max_lanes(s));
      if (block_peak == NEG_INF) {  // no key of this block is in the row's window yet
        store(scores + r * KEY_BLOCK, lanes{});
        continue;
      }
      const lanes weights = exp_lanes(s - block_peak);
      store(scores + r * KEY_BLOCK, weights);
      const float rescale = std::exp(peak[r] - block_peak);
      peak[r] = block_peak;
      total[r] = total[r] * rescale + sum_lanes(weights);

      float* out = acc + r * dim;
      lanes a[VECS];
      for (int j = 0; j < VECS; ++j) a[j] = load(out + j * LANES) * rescale;
      const float* w = scores + r * KEY_BLOCK;
      for (int64_t j = 0; j < nk; ++j) {
        const float* value = c.v + (k0 + j) * c.kv_row + kv_head * dim;
        for (int v = 0; v < VECS; ++v) a[v] += w[j] * load(value + v * LANES);
      }
      for (int j = 0; j < VECS; ++j) store(out + j * LANES, a[j]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = c.out + (q_begin + r / c.group) * c.heads * dim + (kv_head * c.group + r % c.group) * dim;
    const float norm = 1.f / total[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[r * dim + d] * norm;
  }
}

template <int VECS>
void attend(const Chunk& c, int64_t kv_heads) {
  const int64_t blocks = (c.n + QUERY_BLOCK - 1) / QUERY_BLOCK;
  // Later query blocks see more keys: items alternate between the cheap and the dear ends
  // so that each thread's contiguous share of them holds a fair mix.
  at::parallel_for(0, blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t order = item / kv_heads, kv_head = item % kv_heads;
      const int64_t block = order % 2 == 0 ? order / 2 : blocks - 1 - order / 2;
      attend_item<VECS>(c, kv_head, block * QUERY_BLOCK, std::min(c.n, (block + 1) * QUERY_BLOCK), scratch);
    }
  });
}

template <int VECS = MAX_VECS>
void attend_vecs(int64_t vecs, const Chunk& c, int64_t kv_heads) {
  if constexpr (VECS > 1) {
    if (vecs < VECS) return attend_vecs<VECS - 1>(vecs, c, kv_heads);
  }
  attend<VECS>(c, kv_heads);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t window, int64_t query_offset) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2) && k.stride(0) == v.stride(0),
              "prefill_attention: each token's heads must be contiguous, k and v with one row stride");
  TORCH_CHECK(query_offset >= 0 && k.sizes() == v.sizes() && k.size(0) == query_offset + q.size(0) &&
                  k.size(2) == q.size(2),
              "q, k and v disagree: k and v need query_offset + len(q) positions");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of kv heads");
  const int64_t head_dim = q.size(2);
  // Multiples of 16 on every CPU (a vector is 16 or 8 lanes), as prefill_kernel_for promises.
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= MAX_VECS * LANES,
              "prefill_attention: head_dim must be a multiple of 16, at most ", MAX_VECS * LANES);
  at::Tensor out = at::empty({q.size(0), q.size(1) * head_dim}, q.options());
  if (q.size(0) == 0) return out;
  const Chunk c{q.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
                out.mutable_data_ptr<float>(), q.size(0), q.size(1), head_dim, q.size(1) / k.size(1),
                q.stride(0), k.stride(0), window, query_offset, static_cast<float>(scale)};
  attend_vecs(head_dim / LANES, c, k.size(1));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0, int query_offset=0) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
