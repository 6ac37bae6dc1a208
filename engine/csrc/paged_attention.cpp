// Paged decode attention on the CPU: one query token per sequence attends to its
// context read in place from the block pool, with no padded copy of the context.
//
// Registered as torch.ops.tiergate.paged_decode_attention. Work is split over
// sequences (or (sequence, kv head) pairs when there are fewer sequences than
// threads) with at::parallel_for, so it runs on the calling thread's torch
// thread count. The query heads that share a KV head are handled together, so
// each key and value row is read from memory once for all of them. One pass per
// block with an online softmax; scores, softmax and the weighted sum of values
// accumulate in float32. A sliding window (window > 0) starts the pass at the
// first position the window keeps; soft-capping (softcap > 0) bends each score
// through softcap * tanh(score / softcap) before the softmax. Written by hand
// because no library op reads a paged pool in place on the CPU (torch's SDPA
// needs the context contiguous).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t PREFETCH_ROWS = 8;

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(1), kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / kv_heads;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t table_row = block_tables.stride(0);
  // The cache is contiguous [blocks, block_size, 2, kv_heads, head_dim].
  const int64_t kv_stride = kv_heads * head_dim, token_stride = 2 * kv_stride;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* cache = kv_cache.const_data_ptr<scalar_t>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const float softmax_scale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  const int64_t row_bytes = token_stride * int64_t(sizeof(scalar_t));

  // A work item is one sequence with all its KV heads, so each block is read front
  // to back as the hardware prefetcher likes; with fewer sequences than threads, a
  // sequence is split by KV head instead so that every thread has work.
  const int64_t splits = batch >= at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_item = kv_heads / splits, rows = heads_per_item * group;

  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    // Per query head of the item: its scaled query, running max, running sum and output.
    std::vector<float> query(rows * head_dim), acc(rows * head_dim), peak(rows), total(rows), rescale(rows);
    std::vector<float> scores(rows * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits, first_kv_head = (item % splits) * heads_per_item;
      const int64_t ctx = lens[seq];
      // The window keeps positions [first, ctx): HF's kv_idx > q_idx - window with q_idx = ctx - 1.
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t* table = tables + seq * table_row;
      const scalar_t* q_seq = q_data + seq * q_row + first_kv_head * group * q_head;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d)
          query[r * head_dim + d] = static_cast<float>(q_seq[r * q_head + d]) * softmax_scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);

      // One pass over the context, a block at a time (online softmax): the block's
      // keys and values are read once, while they are in cache.
      for (int64_t start = first - first % block_size; start < ctx; start += block_size) {
        const scalar_t* block = cache + table[start / block_size] * block_size * token_stride + first_kv_head * head_dim;
        const int64_t n = std::min(block_size, ctx - start);
        // Positions of the first block before the window score -inf: their weight is zero.
        const int64_t skip = std::max<int64_t>(0, first - start);
        for (int64_t t = 0; t < skip; ++t)
          for (int64_t r = 0; r < rows; ++r) scores[r * block_size + t] = -std::numeric_limits<float>::infinity();
        for (int64_t t = skip; t < n; ++t) {
          // The hardware prefetcher does not follow the block table, so ask for the token
          // row PREFETCH_ROWS positions ahead (keys and values of all heads) ourselves.
          const int64_t ahead = start + t + PREFETCH_ROWS;
          if (ahead < ctx) {
            const char* row = reinterpret_cast<const char*>(
                cache + (table[ahead / block_size] * block_size + ahead % block_size) * token_stride);
            for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte);
          }
          const scalar_t* keys = block + t * token_stride;
          for (int64_t r = 0; r < rows; ++r) {
            const float* qr = query.data() + r * head_dim;
            const scalar_t* key = keys + (r / group) * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * static_cast<float>(key[d]);
            scores[r * block_size + t] = cap > 0.f ? cap * std::tanh(dot / cap) : dot;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * block_size;
          float block_peak = peak[r];
          for (int64_t t = 0; t < n; ++t) block_peak = std::max(block_peak, s[t]);
          rescale[r] = std::exp(peak[r] - block_peak);
          float sum = total[r] * rescale[r];
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - block_peak);
            sum += s[t];
          }
          peak[r] = block_peak;
          total[r] = sum;
          if (rescale[r] != 1.f) {
            float* a = acc.data() + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale[r];
          }
        }
        for (int64_t t = skip; t < n; ++t) {
          const scalar_t* values = block + kv_stride + t * token_stride;
          for (int64_t r = 0; r < rows; ++r) {
            const scalar_t* value = values + (r / group) * head_dim;
            const float p = scores[r * block_size + t];
            float* a = acc.data() + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(value[d]);
          }
        }
      }
      scalar_t* dst = out_data + (seq * num_heads + first_kv_head * group) * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const float norm = 1.f / total[r];
        for (int64_t d = 0; d < head_dim; ++d) dst[r * head_dim + d] = static_cast<scalar_t>(acc[r * head_dim + d] * norm);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [batch, heads, head_dim] with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [blocks, block_size, 2, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(), "q and kv_cache must have the same dtype");
  TORCH_CHECK(kv_cache.size(4) == q.size(2), "q and kv_cache head_dim differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [batch, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0) && block_tables.size(0) == q.size(0),
              "block_tables and context_lens need one row per query");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q, kv_cache, block_tables, context_lens, scale, window, softcap, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tiergate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0, float softcap=0.0) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
