// Paged decode attention on the CPU: one query token per sequence attends to its
// context read in place from the block pool, with no padded copy of the context.
//
// Registered as torch.ops.tiergate.paged_decode_attention, for float32, bfloat16 and
// Q8_0 (kv_heads.h, uint8) caches (scores, softmax and sums in float32 either way). Work is split over
// sequences (or (sequence, kv head) pairs when there are fewer sequences than
// threads, and contexts into parts joined after when those items do not share out
// evenly, as flash-decoding splits them) with at::parallel_for, so it runs on the
// calling thread's torch thread count. One pass over the context a block at a time,
// blocks outermost, so each block is read from memory once for every query head
// sharing its KV heads while it is in cache; per block and query head: the scores,
// their exponentials (a vectorised exp, a vector at a time), an online-softmax
// rescale, and the weighted sum of the values with the head's running output held
// in registers. Head dims up to 256 plus a partial vector (263 with AVX2). A sliding
// window (window > 0) starts the pass at the first position the window keeps;
// soft-capping (softcap > 0) bends each score through softcap * tanh(score / softcap)
// first.
// Written by hand because no library op reads a paged pool in place on the CPU
// (torch's SDPA needs the context contiguous).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kv_heads.h"
#include "paged_attention_work.h"
#include "rope_rotate.h"
#include "simd_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace tiergate_simd;
using tiergate_kv::PlainHeads;
using tiergate_kv::Q8Heads;
using tiergate_paged::Item;
using tiergate_paged::Split;

constexpr int MAX_VECS = MAX_HEAD_VECS;

struct Shapes {
  int64_t num_heads, head_dim, block_size, kv_heads, group, tail;
  int64_t head_bytes, kv_stride, token_stride;  // bytes of a head, from a token's keys to its values, to the next token
};

// One item's `rows` query heads. State per query head: its scaled query, running max, running sum
// and output, each head's output kept in registers while a block is summed.
template <typename scalar_t, typename Heads, int VECS>
void attend_item(const Shapes& s, const scalar_t* q_seq, int64_t q_head, const uint8_t* cache, const int64_t* table,
                 int64_t ctx, int64_t first, const Item& item, float scale, float cap, int64_t rows, scalar_t* dst,
                 float* partial, std::vector<float>& scratch) {
  const int64_t padded_block = (s.block_size + LANES - 1) / LANES * LANES, padded_dim = VECS * LANES + s.tail;
  const int64_t own_heads = (rows + s.group - 1) / s.group;
  const int64_t widened_size = Heads::widened ? s.block_size * 2 * own_heads * s.head_dim : 0;
  scratch.resize(rows * (2 * padded_dim + 2) + padded_block + widened_size);
  float* query = scratch.data();                    // [rows, padded_dim]
  float* acc = query + rows * padded_dim;           // [rows, padded_dim]
  float* peak = acc + rows * padded_dim;            // [rows]
  float* total = peak + rows;                       // [rows]
  float* weights = total + rows;                    // [padded_block]: one head's scores, then e^(score - max)
  float* widened = weights + padded_block;          // [block_size, 2, own_heads, head_dim]: a Q8_0 block as float32
  // What the loops below read a block's keys and values as: the pool's own elements, or for a Q8_0 pool
  // the block's own heads widened to float32 once (widened per query head, a GQA group of three paid for
  // each conversion three times), with the strides of that copy.
  using Read = std::conditional_t<Heads::widened, PlainHeads<float>, Heads>;
  const int64_t read_head = Heads::widened ? s.head_dim * int64_t(sizeof(float)) : s.head_bytes;
  const int64_t read_token = Heads::widened ? 2 * own_heads * read_head : s.token_stride;
  const int64_t read_values = Heads::widened ? own_heads * read_head : s.kv_stride;
  const int64_t read_first_head = Heads::widened ? 0 : item.first_kv_head;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < s.head_dim; ++d) query[r * padded_dim + d] = static_cast<float>(q_seq[r * q_head + d]) * scale;
    peak[r] = NEG_INF;
    total[r] = 0.f;
  }
  std::fill(acc, acc + rows * padded_dim, 0.f);
  const int64_t row_bytes = s.token_stride;
  // A token's row holds every KV head's key, then every value: the item reads only its own heads'.
  // Asking for the whole row cost an item that has one KV head of several three times the requests,
  // which filled the queue of misses the reads wait on.
  const int64_t own_keys = item.first_kv_head * s.head_bytes;
  const int64_t own_bytes = own_heads * s.head_bytes;
  const int64_t value_bytes = s.kv_stride;
  const int64_t end = std::min(ctx, item.block1 * s.block_size);

  for (int64_t start = item.block0 * s.block_size; start < end; start += s.block_size) {
    const uint8_t* block = cache + table[start / s.block_size] * s.block_size * s.token_stride;
    const int64_t n = std::min(s.block_size, ctx - start);
    const int64_t skip = std::max<int64_t>(0, first - start);  // positions before the window
    if constexpr (Heads::widened) {  // a Q8_0 head's size is a multiple of 32: VECS * LANES, no tail
      constexpr int64_t groups = VECS * LANES / tiergate_kv::Q8_GROUP;
      const int64_t head_bytes = s.head_bytes, token_stride = s.token_stride, kv_stride = s.kv_stride;
      for (int64_t t = skip; t < n; ++t)
        for (int64_t half = 0; half < 2; ++half) {
          const uint8_t* from = block + t * token_stride + half * kv_stride + item.first_kv_head * head_bytes;
          float* to = widened + (t * 2 + half) * own_heads * VECS * LANES;
          for (int64_t g = 0; g < own_heads * groups; ++g)
            tiergate_kv::widen_q8_0_group(from + g * tiergate_kv::Q8_BYTES, to + g * tiergate_kv::Q8_GROUP);
        }
      block = reinterpret_cast<const uint8_t*>(widened);
    }
    // The hardware prefetcher does not follow the block table: ask for the next block, a
    // share of its token rows before each query head's turn, so the requests spread over the block.
    // Into L2 (prefetcht1): into L1 a block's requests overran the fill buffers, and decodes over
    // long contexts ran slower (bench/RESULTS.md).
    const int64_t next = start + s.block_size, next_n = std::min(s.block_size, end - next);
    const int64_t rows_per_turn = (next_n + rows - 1) / std::max<int64_t>(rows, 1);
    const uint8_t* next_block =
        next_n > 0 ? cache + table[next / s.block_size] * s.block_size * s.token_stride : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = r * rows_per_turn; t < std::min(next_n, (r + 1) * rows_per_turn); ++t)
        for (const int64_t at : {own_keys, own_keys + value_bytes}) {
          const uintptr_t from = reinterpret_cast<uintptr_t>(next_block + t * row_bytes + at);
          for (uintptr_t line = from & ~uintptr_t(63); line < from + own_bytes; line += 64)
            __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
        }
      const int64_t head_offset = (read_first_head + r / s.group) * read_head;
      lanes qv[VECS];
      for (int j = 0; j < VECS; ++j) qv[j] = load(query + r * padded_dim + j * LANES);
      std::fill(weights, weights + padded_block, NEG_INF);
      const float* q_tail = query + r * padded_dim + VECS * LANES;
      int64_t t = skip;
      for (; t + LANES <= n; t += LANES) {  // LANES tokens' scores, summed across lanes together (sum_each)
        lanes dots[LANES];
        for (int64_t u = 0; u < LANES; ++u) {
          const uint8_t* key = block + (t + u) * read_token + head_offset;
          lanes dot = {};
          for (int j = 0; j < VECS; ++j) dot += qv[j] * Read::vec(key, j);
          dots[u] = dot;
        }
        lanes scores = sum_each(dots);
        for (int64_t u = 0; u < LANES && s.tail > 0; ++u) {
          const uint8_t* key = block + (t + u) * read_token + head_offset;
          for (int64_t d = 0; d < s.tail; ++d) scores[u] += q_tail[d] * Read::at(key, VECS * LANES + d);
        }
        store(weights + t, scores);
      }
      for (; t < n; ++t) {
        const uint8_t* key = block + t * read_token + head_offset;
        lanes dot = {};
        for (int j = 0; j < VECS; ++j) dot += qv[j] * Read::vec(key, j);
        float score = sum_lanes(dot);
        for (int64_t d = 0; d < s.tail; ++d) score += q_tail[d] * Read::at(key, VECS * LANES + d);
        weights[t] = score;
      }
      // Apart from the loops above: a call to tanh there would keep the query's vectors out of the registers.
      if (cap > 0.f)
        for (int64_t u = skip; u < n; ++u) weights[u] = cap * std::tanh(weights[u] / cap);
      // A vector at a time over the whole padded block (the places past [skip, n) hold -inf): a scalar
      // max over the tokens was one chain of dependent instructions, a tenth of the kernel's time.
      lanes peaks = load(weights);
      for (int64_t t = LANES; t < padded_block; t += LANES) peaks = max_each(peaks, load(weights + t));
      const float block_peak = std::max(peak[r], max_lanes(peaks));
      lanes sums = {};
      for (int64_t t = 0; t < padded_block; t += LANES) {
        const lanes e = exp_lanes(load(weights + t) - block_peak);
        std::memcpy(weights + t, &e, sizeof(e));
        sums += e;
      }
      const float rescale = std::exp(peak[r] - block_peak);  // 0 on the first block: peak was -inf
      peak[r] = block_peak;
      total[r] = total[r] * rescale + sum_lanes(sums);

      float* out = acc + r * padded_dim;
      lanes a[VECS];
      for (int j = 0; j < VECS; ++j) a[j] = load(out + j * LANES) * rescale;
      for (int64_t d = 0; d < s.tail; ++d) out[VECS * LANES + d] *= rescale;
      for (int64_t t = skip; t < n; ++t) {
        const uint8_t* value = block + t * read_token + read_values + head_offset;
        const float w = weights[t];
        for (int j = 0; j < VECS; ++j) a[j] += w * Read::vec(value, j);
        for (int64_t d = 0; d < s.tail; ++d) out[VECS * LANES + d] += w * Read::at(value, VECS * LANES + d);
      }
      for (int j = 0; j < VECS; ++j) std::memcpy(out + j * LANES, &a[j], sizeof(lanes));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (partial != nullptr) {  // [rows, 2 + head_dim]: max, sum, output
      float* p = partial + r * (2 + s.head_dim);
      p[0] = peak[r], p[1] = total[r];
      std::copy_n(acc + r * padded_dim, s.head_dim, p + 2);
      continue;
    }
    const float norm = 1.f / total[r];
    for (int64_t d = 0; d < s.head_dim; ++d)
      dst[r * s.head_dim + d] = static_cast<scalar_t>(acc[r * padded_dim + d] * norm);
  }
}

template <typename scalar_t, typename Heads, int VECS>
void attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  // The cache is contiguous [blocks, block_size, 2, kv_heads, head_dim (or its Q8_0 bytes)].
  const int64_t head_bytes = Heads::head_bytes(head_dim);
  const Shapes s{num_heads, head_dim, kv_cache.size(1), kv_heads, num_heads / kv_heads, head_dim % LANES,
                 head_bytes, kv_heads * head_bytes, 2 * kv_heads * head_bytes};
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const uint8_t* cache = static_cast<const uint8_t*>(kv_cache.const_data_ptr());
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  // A work item is one sequence with all its KV heads, so each block is read front to back as the
  // hardware prefetcher likes; with fewer sequences than threads, a sequence is split by KV head,
  // and where that still leaves a thread idle part of the time, its context into parts as well
  // (one sequence's three KV heads on two threads kept one of them waiting a third of the call).
  const int64_t threads = at::get_num_threads();
  const int64_t splits = batch >= threads ? 1 : kv_heads;
  const int64_t heads_per_item = kv_heads / splits, rows = heads_per_item * s.group;
  // A window keeps positions [first, ctx): HF's kv_idx > q_idx - window with q_idx = ctx - 1.
  auto first_of = [&](int64_t seq) { return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : int64_t(0); };
  int64_t total_blocks = 0, longest = 0;
  for (int64_t seq = 0; seq < batch; ++seq) {
    const int64_t blocks = (lens[seq] + s.block_size - 1) / s.block_size - first_of(seq) / s.block_size;
    total_blocks += splits * blocks;
    longest = std::max(longest, blocks);
  }
  const int64_t part_blocks = tiergate_paged::blocks_per_part(batch * splits, total_blocks, longest, threads);
  std::vector<Item> items;
  std::vector<Split> split_contexts;
  int64_t slots = 0;
  for (int64_t seq = 0; seq < batch; ++seq) {
    const int64_t b0 = first_of(seq) / s.block_size, b1 = (lens[seq] + s.block_size - 1) / s.block_size;
    const int64_t parts =
        part_blocks > 0 ? std::max<int64_t>(1, std::min((b1 - b0 + part_blocks - 1) / part_blocks, b1 - b0)) : 1;
    for (int64_t split = 0; split < splits; ++split) {
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({seq, split * heads_per_item, b0 + p * (b1 - b0) / parts, b0 + (p + 1) * (b1 - b0) / parts,
                         parts > 1 ? slots + p : -1});
      if (parts > 1) split_contexts.push_back({seq, split * heads_per_item * s.group, slots, parts});
      slots += parts > 1 ? parts : 0;
    }
  }
  std::vector<float> partials(slots * rows * (2 + head_dim));
  const std::vector<int64_t> starts = tiergate_paged::runs_by_blocks(items, threads);
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t last_run) {
    std::vector<float> scratch;
    for (int64_t i = starts[first_run]; i < starts[last_run]; ++i) {
      const Item& item = items[i];
      const int64_t first_row = item.first_kv_head * s.group;
      attend_item<scalar_t, Heads, VECS>(
          s, q_data + item.seq * q.stride(0) + first_row * q.stride(1), q.stride(1), cache,
          tables + item.seq * block_tables.stride(0), lens[item.seq], first_of(item.seq), item,
          static_cast<float>(scale), static_cast<float>(softcap), rows,
          out_data + (item.seq * num_heads + first_row) * head_dim,
          item.slot >= 0 ? partials.data() + item.slot * rows * (2 + head_dim) : nullptr, scratch);
    }
  });
  if (split_contexts.empty()) return;
  at::parallel_for(0, int64_t(split_contexts.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Split& split = split_contexts[i];
      tiergate_paged::combine_parts(head_dim, split, rows, partials.data(),
                                    out_data + (split.seq * num_heads + split.first_row) * head_dim);
    }
  });
}

// The head's count of whole vectors as a template argument, so its running output stays in
// registers; the rest of a head whose size is not a multiple of 16 is summed one by one.
template <typename scalar_t, typename Heads, int VECS = MAX_VECS>
void attend_vecs(int64_t vecs, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, double scale, int64_t window, double softcap, at::Tensor& out) {
  if constexpr (VECS > 0) {
    if (vecs < VECS)
      return attend_vecs<scalar_t, Heads, VECS - 1>(vecs, q, kv_cache, block_tables, context_lens, scale, window,
                                                    softcap, out);
  }
  attend<scalar_t, Heads, VECS>(q, kv_cache, block_tables, context_lens, scale, window, softcap, out);
}

template <typename scalar_t>
void attend_cache(int64_t vecs, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, double scale, int64_t window, double softcap, at::Tensor& out) {
  if (kv_cache.scalar_type() == at::kByte)
    attend_vecs<scalar_t, Q8Heads>(vecs, q, kv_cache, block_tables, context_lens, scale, window, softcap, out);
  else
    attend_vecs<scalar_t, PlainHeads<scalar_t>>(vecs, q, kv_cache, block_tables, context_lens, scale, window, softcap,
                                                out);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [batch, heads, head_dim] with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [blocks, block_size, 2, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 only");
  if (kv_cache.scalar_type() == at::kByte) {
    TORCH_CHECK(q.size(2) % tiergate_kv::Q8_GROUP == 0 && kv_cache.size(4) == tiergate_kv::q8_head_bytes(q.size(2)),
                "a Q8_0 kv_cache holds head_dim / 32 blocks of 34 bytes a head, head_dim a multiple of 32");
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(),
                "q and kv_cache must have the same dtype (or a uint8 Q8_0 cache)");
    TORCH_CHECK(kv_cache.size(4) == q.size(2), "q and kv_cache head_dim differ");
  }
  TORCH_CHECK(q.size(2) < (MAX_VECS + 1) * LANES, "paged_decode_attention: head_dim above ", (MAX_VECS + 1) * LANES - 1);
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [batch, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0) && block_tables.size(0) == q.size(0),
              "block_tables and context_lens need one row per query");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const int64_t vecs = q.size(2) / LANES;
  if (q.scalar_type() == at::kFloat)
    attend_cache<float>(vecs, q, kv_cache, block_tables, context_lens, scale, window, softcap, out);
  else
    attend_cache<c10::BFloat16>(vecs, q, kv_cache, block_tables, context_lens, scale, window, softcap, out);
  return out;
}

// A decode step's attention from the fused q|k|v projection [batch, (heads + 2 * kv_heads) * head_dim],
// float32: each row's query and key heads rotated in place (RoPE; cos and the sign-folded sin
// [batch, 1, head_dim] as rope_ takes them), its keys and values written to its slot of the pool (float32,
// or Q8_0 bytes), then paged_decode_attention. One call where the Python around it made six (the slices, the
// rotation, the write): at a decode step each of those cost more to dispatch than to compute, thirty layers over.
at::Tensor rope_decode_attention(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t num_heads, double scale, int64_t window,
                                 double softcap) {
  const bool q8 = kv_cache.scalar_type() == at::kByte;
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat &&
                  (kv_cache.scalar_type() == at::kFloat || q8) && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rope_decode_attention: float32 CPU tensors only (the cache float32 or Q8_0)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [blocks, block_size, 2, kv_heads, head_dim]");
  const int64_t batch = qkv.size(0), kv_heads = kv_cache.size(3);
  const int64_t head_dim = q8 ? qkv.size(1) / (num_heads + 2 * kv_heads) : kv_cache.size(4);
  TORCH_CHECK(!q8 || kv_cache.size(4) == tiergate_kv::q8_head_bytes(head_dim),
              "a Q8_0 kv_cache holds head_dim / 32 blocks of 34 bytes a head");
  const int64_t rotated = num_heads + kv_heads, kv_row = 2 * kv_heads * head_dim;
  const int64_t slot_bytes = 2 * kv_heads * kv_cache.size(4) * kv_cache.element_size();
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim &&
                  head_dim % 2 == 0, "qkv must be [batch, (heads + 2 * kv_heads) * even head_dim], rows contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * head_dim &&
                  sin.numel() == batch * head_dim, "cos and sin must be contiguous [batch, 1, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == batch,
              "slot_mapping must be int64 [batch]");
  const int64_t slots = kv_cache.size(0) * kv_cache.size(1), half = head_dim / 2;
  const int64_t* slot = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < batch; ++row)
    TORCH_CHECK(slot[row] >= 0 && slot[row] < slots, "slot ", slot[row], " is outside the pool");
  float* data = qkv.mutable_data_ptr<float>();
  uint8_t* cache = static_cast<uint8_t*>(kv_cache.mutable_data_ptr());
  const float* c = cos.const_data_ptr<float>();
  const float* sn = sin.const_data_ptr<float>();
  for (int64_t row = 0; row < batch; ++row) {
    float* heads = data + row * qkv.stride(0);
    const float* ct = c + row * head_dim;
    const float* st = sn + row * head_dim;
    for (int64_t h = 0; h < rotated; ++h) tiergate_rope::rotate_head(heads + h * head_dim, ct, st, half);
    const float* kv = heads + num_heads * head_dim;
    if (!q8) {
      std::memcpy(cache + slot[row] * slot_bytes, kv, kv_row * sizeof(float));
      continue;
    }
    for (int64_t h = 0; h < 2 * kv_heads; ++h)
      tiergate_kv::quantize_q8_0_head(kv + h * head_dim, head_dim,
                                      cache + slot[row] * slot_bytes + h * kv_cache.size(4));
  }
  const at::Tensor q = qkv.as_strided({batch, num_heads, head_dim}, {qkv.stride(0), head_dim, 1});
  return paged_decode_attention(q, kv_cache, block_tables, context_lens, scale, window, softcap);
}

}  // namespace

TORCH_LIBRARY(tiergate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0, float softcap=0.0) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("rope_decode_attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, int num_heads, float scale, int window=0, float softcap=0.0) "
        "-> Tensor");
  m.impl("rope_decode_attention", c10::DispatchKey::CPU, TORCH_FN(rope_decode_attention));
}
