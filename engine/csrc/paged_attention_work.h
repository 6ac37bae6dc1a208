// How one paged decode attention call's work is cut into items and shared between threads
// (csrc/paged_attention.cpp): a sequence, or a sequence's KV heads, or a part of its context; and how
// the parts of a cut context are joined.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tiergate_paged {

// One work item: sequence `seq`'s query heads from `first_kv_head`'s first on, over its context blocks
// [block0, block1). `slot` >= 0: one part of a context split between threads, its result left
// unnormalised in the partials (combine_parts joins them); -1: the whole context, written out.
struct Item {
  int64_t seq, first_kv_head, block0, block1, slot;
};

// A sequence's KV-head group whose context was split into `parts` items, in partials slots
// [first_slot, first_slot + parts).
struct Split {
  int64_t seq, first_row, first_slot, parts;
};

// Context blocks a part may hold (0: contexts stay whole). Where the items are few and do not share
// out evenly over the threads (one sequence's three KV heads on two), every context is cut, into
// parts of about total / (ITEMS_PER_THREAD * threads) blocks; where one context alone holds more than
// a thread's share of the call's blocks (one long sequence among short ones), those longer than half
// a share are cut into half shares. Elsewhere nothing is cut: a cut costs the join's second pass and
// parallel region, which cost more than they saved where the items already shared out evenly.
constexpr int64_t ITEMS_PER_THREAD = 4, MIN_PART_BLOCKS = 2;
inline int64_t blocks_per_part(int64_t items, int64_t total_blocks, int64_t longest, int64_t threads) {
  if (threads <= 1) return 0;
  if (items < ITEMS_PER_THREAD * threads && items % threads != 0)
    return std::max(MIN_PART_BLOCKS, (total_blocks + ITEMS_PER_THREAD * threads - 1) / (ITEMS_PER_THREAD * threads));
  const int64_t share = (total_blocks + threads - 1) / threads;
  return longest > share ? std::max(MIN_PART_BLOCKS, (share + 1) / 2) : 0;
}

// Where each thread's run of items begins (and, last, where the items end): runs of about equal
// blocks, so that a long context's thread is not also handed as many short ones as the others.
inline std::vector<int64_t> runs_by_blocks(const std::vector<Item>& items, int64_t threads) {
  int64_t total = 0;
  for (const Item& item : items) total += item.block1 - item.block0;
  std::vector<int64_t> starts(threads + 1, int64_t(items.size()));
  starts[0] = 0;
  int64_t done = 0, thread = 0;
  for (int64_t i = 0; i < int64_t(items.size()); ++i) {
    const int64_t blocks = items[i].block1 - items[i].block0;
    // An item goes to the thread whose share holds its middle block.
    const int64_t owner = std::min(threads - 1, (2 * done + blocks) * threads / (2 * std::max<int64_t>(total, 1)));
    while (thread < owner) starts[++thread] = i;
    done += blocks;
  }
  return starts;
}

// The parts of one split context as one softmax: each part's sums rescaled to the largest max.
template <typename scalar_t>
void combine_parts(int64_t head_dim, const Split& split, int64_t rows, const float* partials, scalar_t* dst) {
  const int64_t stride = rows * (2 + head_dim);
  std::vector<float> out(head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* first = partials + split.first_slot * stride + r * (2 + head_dim);
    float peak = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < split.parts; ++p) peak = std::max(peak, first[p * stride]);
    std::fill(out.begin(), out.end(), 0.f);
    for (int64_t p = 0; p < split.parts; ++p) {
      const float* part = first + p * stride;
      const float weight = std::exp(part[0] - peak);
      total += part[1] * weight;
      for (int64_t d = 0; d < head_dim; ++d) out[d] += part[2 + d] * weight;
    }
    for (int64_t d = 0; d < head_dim; ++d) dst[r * head_dim + d] = static_cast<scalar_t>(out[d] / total);
  }
}

}  // namespace tiergate_paged
