// Batched LoRA for rows of many adapters at once on the CPU (punica's BGMV and its prefill form).
//
// Registered as torch.ops.tiergate.lora_rows_, called by lora_pool/ops.py for every row of a step
// that has an adapter: torch would need a gather, two bmms over padded stacks, a cat and an
// index_add per projection group for the decode rows (each a dispatch that costs about what its
// arithmetic does, thirty layers over) and a matmul pair per adapter for the prefill chunks. Here
// one call reads each slot's A and B once per few rows and updates the rows in place, memory-bound
// on the stacks as the bmms were not.
//
// The stacks are lora_pool/ops.py's CPU layout, rank-major: a [slots, projections * max_rank, in]
// (the group's A one after another along the rank) and b_p [slots, max_rank, out_p] per
// projection, contiguous, in float32 or bfloat16 (half the bytes, widened to float32 as they load;
// the activations and sums stay float32). The rows come grouped by slot: group g is slot slots[g],
// rows rows[offsets[g]:offsets[g + 1]] of x and y, rank ranks[g] (the stacks' rows past it are
// zeros, and nothing reads them) and scale scales[g]. y's columns are the projections' outputs
// side by side.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "simd_lanes.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace tiergate_simd;

// A slot's rows go NR (1 to MAX_ROWS) at a time, and its stacks a few rank rows at a time, so each
// row of A and of b is loaded once for the NR rows: in the shrink, NJ (1 to MAX_DOTS) of A's rows are
// dotted with the NR rows of x, their NR x NJ sums in registers (AVX2 has 16 of them, AVX-512 32);
// in the expand, expand_dots<NR>() of b's rows are added into the NR rows of y in one sweep.
constexpr int MAX_ROWS = 4, MAX_DOTS = LANES == 16 ? 4 : 2;

// The byte runs a thread's pieces read from memory, in the order they read them, and a cursor that
// prefetches PREFETCH_BYTES ahead of the reads through them. A slot's stacks are a few short runs
// (each projection's rank rows of A, then of each b), each read as NJ streams at once: the hardware
// prefetchers start late on such streams and stop at each run's end, where the next run (the next
// projection's, or the next slot's) could already be on its way. All runs are known before the reads.
// LOCALITY is __builtin_prefetch's: 3 into L1, 2 into L2. Which pays depends on the core (L1 on a
// Zen 5, L2 on a Zen 4: bench/RESULTS.md, multi-LoRA), so the caller chooses (lora_pool/ops.py).
constexpr int64_t PREFETCH_BYTES = 16384, LINE_BYTES = 64;

struct Run {
  const char* begin;
  int64_t bytes;
};

// The cursor is a few words, copied into each kernel loop's locals: kept in the object, its fields
// would be stored and reloaded at every step, as the loops' stores to y may alias them.
template <int LOCALITY>
class ReadAhead {
 public:
  explicit ReadAhead(const std::vector<Run>& runs) : runs_(runs.data()), count_(runs.size()) {
    if (count_ == 0) fetched_ = DONE;
  }

  // The reads have gone `bytes` further through the runs: keep the lines up to PREFETCH_BYTES past them
  // coming. Inlined into the kernels' loops: a call there would spill their sums from the registers.
  __attribute__((always_inline)) void advance(int64_t bytes) {
    read_ += bytes;
    while (fetched_ < read_ + PREFETCH_BYTES) {
      const Run& run = runs_[run_];
      __builtin_prefetch(run.begin + offset_, 0, LOCALITY);
      const int64_t step = std::min(LINE_BYTES, run.bytes - offset_);
      offset_ += step, fetched_ += step;
      if (offset_ == run.bytes) {
        ++run_, offset_ = 0;
        if (run_ == count_) fetched_ = DONE;
      }
    }
  }

 private:
  static constexpr int64_t DONE = std::numeric_limits<int64_t>::max() / 2;  // every run on its way
  const Run* runs_;
  size_t count_, run_ = 0;
  int64_t offset_ = 0, read_ = 0, fetched_ = 0;
};

// For a piece's rows after its first few: the first read the stacks from memory, these find them in
// the caches, and the prefetching's code in their loops would only take registers.
struct InCache {
  void advance(int64_t) {}
};

// t[r, j0 + k] = x[rows[r]] . a[j0 + k], for NR rows and NJ of a's rows (each `in` long).
template <int NR, int NJ, typename W, typename Reads>
void shrink_block(const float* const* xr, const W* a, int64_t in, int64_t j0, int64_t wide, float* t, Reads& reads) {
  Reads ahead = reads;
  const W* aj[NJ];
  for (int k = 0; k < NJ; ++k) aj[k] = a + (j0 + k) * in;
  lanes acc[NR][NJ] = {};
  int64_t i = 0;
  for (; i + LANES <= in; i += LANES) {
    lanes av[NJ];
    ahead.advance(NJ * LANES * sizeof(W));
    for (int k = 0; k < NJ; ++k) av[k] = load(aj[k] + i);
    for (int r = 0; r < NR; ++r) {
      const lanes xv = load(xr[r] + i);
      for (int k = 0; k < NJ; ++k) acc[r][k] += xv * av[k];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < NJ; ++k) {
      float sum = sum_lanes(acc[r][k]);
      for (int64_t tail = i; tail < in; ++tail) sum += xr[r][tail] * static_cast<float>(aj[k][tail]);
      t[r * wide + j0 + k] = sum;
    }
  reads = ahead;
}

// Calls block(NJ, j0) over the rank rows [begin, end), MAX_DOTS at a time and then the 1 to 3 left
// (NJ as a std::integral_constant, for the templates).
template <typename Block>
void rank_blocks(int64_t begin, int64_t end, Block block) {
  int64_t j0 = begin;
  for (; j0 + MAX_DOTS <= end; j0 += MAX_DOTS) block(std::integral_constant<int, MAX_DOTS>{}, j0);
  switch (end - j0) {
    case 3: block(std::integral_constant<int, 3>{}, j0); break;
    case 2: block(std::integral_constant<int, 2>{}, j0); break;
    case 1: block(std::integral_constant<int, 1>{}, j0); break;
    default: break;
  }
}

// A is rank-major per slot ([projections * max_rank, in], each projection's rows from p * max_rank),
// so an adapter below max_rank reads only its own rows: the padding rows are never touched.
template <int NR, typename W, typename Reads>
void shrink_rows(const float* const* xr, const W* a, int64_t in, int64_t wide, int64_t max_rank, int64_t rank,
                 float* t, Reads& ahead) {
  for (int64_t p0 = 0; p0 < wide; p0 += max_rank)
    rank_blocks(p0, p0 + rank, [&](auto nj, int64_t j0) {
      shrink_block<NR, decltype(nj)::value>(xr, a, in, j0, wide, t, ahead);
    });
}

// How many of b's rank rows one sweep over y's columns takes for NR rows: the NR x NJ broadcasts of
// t and the NR sums must stay in registers (32 of them with AVX-512, 16 with AVX2). More rank rows a
// sweep means fewer sweeps, and each sweep loads and stores the NR rows of y once.
template <int NR>
constexpr int expand_dots() {
  int dots = 1;
  while (dots * 2 * NR <= (LANES == 16 ? 16 : 8)) dots *= 2;
  return dots;
}

// y[rows[r]] += tr[r, j0 : j0 + NJ] @ b[j0 : j0 + NJ], for NR rows: b's NJ rows are read front to
// back, each once for the NR rows; each vector of y is loaded and stored once for the NJ rows.
template <int NR, int NJ, typename W, typename Reads>
void expand_block(float* const* yr, const float* const* tr, const W* b, int64_t out, int64_t j0, Reads& reads) {
  Reads ahead = reads;
  const W* bj = b + j0 * out;
  lanes tv[NR][NJ];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < NJ; ++k) tv[r][k] = lanes{} + tr[r][j0 + k];
  int64_t o = 0;
  for (; o + LANES <= out; o += LANES) {
    ahead.advance(NJ * LANES * sizeof(W));
    lanes acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = load(yr[r] + o);
    for (int k = 0; k < NJ; ++k) {
      const lanes bv = load(bj + k * out + o);
      for (int r = 0; r < NR; ++r) acc[r] += tv[r][k] * bv;
    }
    for (int r = 0; r < NR; ++r) store(yr[r] + o, acc[r]);
  }
  for (; o < out; ++o)
    for (int r = 0; r < NR; ++r) {
      float sum = yr[r][o];
      for (int k = 0; k < NJ; ++k) sum += tr[r][j0 + k] * static_cast<float>(bj[k * out + o]);
      yr[r][o] = sum;
    }
  reads = ahead;
}

// The rank rows from j0 that a block of NJ leaves: halves of it, each at most once.
template <int NR, int NJ, typename W, typename Reads>
void expand_rest(float* const* yr, const float* const* tr, const W* b, int64_t out, int64_t j0, int64_t rank,
                 Reads& ahead) {
  if constexpr (NJ >= 1) {
    if (j0 + NJ <= rank) {
      expand_block<NR, NJ>(yr, tr, b, out, j0, ahead);
      j0 += NJ;
    }
    expand_rest<NR, NJ / 2>(yr, tr, b, out, j0, rank, ahead);
  }
}

template <int NR, typename W, typename Reads>
void expand_rows(float* const* yr, const float* const* tr, const W* b, int64_t out, int64_t rank, Reads& ahead) {
  constexpr int NJ = expand_dots<NR>();
  int64_t j0 = 0;
  for (; j0 + NJ <= rank; j0 += NJ) expand_block<NR, NJ>(yr, tr, b, out, j0, ahead);
  expand_rest<NR, NJ / 2>(yr, tr, b, out, j0, rank, ahead);
}

struct Stacks {
  int64_t in, wide, max_rank;
  std::vector<int64_t> widths;  // each projection's output columns
};

// NR rows of one slot (rows[0..NR)): shrink, scale, then expand into each projection's columns.
template <int NR, typename W, typename Reads>
void slot_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const W* a_slot,
               const std::vector<const W*>& b_slot, const Stacks& st, const int64_t* rows, int64_t rank, float scale,
               float* t, Reads& ahead) {
  const float* xr[NR];
  float* yr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + rows[r] * x_stride, yr[r] = y + rows[r] * y_stride;
  shrink_rows<NR>(xr, a_slot, st.in, st.wide, st.max_rank, rank, t, ahead);
  for (int64_t i = 0; i < NR * st.wide; ++i) t[i] *= scale;
  int64_t col = 0;
  for (size_t p = 0; p < b_slot.size(); ++p) {
    const float* tr[NR];
    float* yc[NR];
    for (int r = 0; r < NR; ++r) tr[r] = t + r * st.wide + p * st.max_rank, yc[r] = yr[r] + col;
    expand_rows<NR>(yc, tr, b_slot[p], st.widths[p], rank, ahead);
    col += st.widths[p];
  }
}

// A run of one group's rows, the unit the threads share: a prefill chunk of one adapter is many
// pieces, so it spreads over the threads as the decode rows of many adapters do. Each piece reads
// its slot's stacks once per MAX_ROWS of its rows; a thread's pieces are consecutive, so the pieces
// of one group mostly find that slot's stacks in its caches.
struct Piece {
  int64_t group, begin, end;
};
constexpr int64_t PIECE_ROWS = 4 * MAX_ROWS;

std::vector<Piece> pieces_of(const int64_t* offsets, int64_t groups) {
  std::vector<Piece> pieces;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; r += PIECE_ROWS)
      pieces.push_back({g, r, std::min(r + PIECE_ROWS, offsets[g + 1])});
  return pieces;
}

// Where to cut the pieces into `parts` consecutive runs of about equal work, one a thread: a piece costs its
// rank times its rows plus MAX_ROWS (reading its slot's stacks from memory weighs about as much as that
// many rows of arithmetic). Cut by count, as at::parallel_for cuts, 16 adapters whose first 8 were rank 8
// and the rest rank 16 left one thread twice the other's bytes (bench/kernels/lora_step.py --ranks halves).
std::vector<int64_t> cuts_of(const std::vector<Piece>& pieces, const int64_t* ranks, int64_t parts) {
  std::vector<double> upto(pieces.size() + 1, 0.0);
  for (size_t i = 0; i < pieces.size(); ++i)
    upto[i + 1] = upto[i] + double(ranks[pieces[i].group]) * double(pieces[i].end - pieces[i].begin + MAX_ROWS);
  std::vector<int64_t> cuts{0};
  for (int64_t k = 1; k < parts; ++k) {
    const double goal = upto.back() * double(k) / double(parts);
    int64_t at = std::lower_bound(upto.begin(), upto.end(), goal) - upto.begin();
    if (at > 0 && goal - upto[at - 1] < upto[at] - goal) --at;  // the nearer of the two boundaries
    cuts.push_back(std::max(cuts.back(), at));
  }
  cuts.push_back(static_cast<int64_t>(pieces.size()));
  return cuts;
}

template <typename W, int LOCALITY>
void lora_pieces(const float* x, int64_t x_stride, float* y, int64_t y_stride, const W* a, const std::vector<const W*>& b,
                 const Stacks& st, const int64_t* slots, const int64_t* rows, const int64_t* ranks, const float* scales,
                 const Piece* pieces, int64_t count) {
  std::vector<float> t(MAX_ROWS * st.wide);
  std::vector<const W*> b_slot(b.size());
  // What each piece's first NR rows will read, in order; its later rows find those stacks in the caches.
  std::vector<Run> runs;
  auto add = [&](const void* begin, int64_t bytes) {
    if (bytes > 0) runs.push_back({static_cast<const char*>(begin), bytes});
  };
  for (const Piece* piece = pieces; piece < pieces + count; ++piece) {
    const int64_t slot = slots[piece->group], rank = ranks[piece->group];
    for (int64_t p0 = 0; p0 < st.wide; p0 += st.max_rank)
      add(a + (slot * st.wide + p0) * st.in, rank * st.in * sizeof(W));
    for (size_t p = 0; p < b.size(); ++p)
      add(b[p] + slot * st.max_rank * st.widths[p], rank * st.widths[p] * sizeof(W));
  }
  ReadAhead<LOCALITY> ahead(runs);
  InCache cached;
  for (const Piece* piece = pieces; piece < pieces + count; ++piece) {
    const int64_t g = piece->group, slot = slots[g];
    const W* a_slot = a + slot * st.in * st.wide;
    for (size_t p = 0; p < b.size(); ++p) b_slot[p] = b[p] + slot * st.max_rank * st.widths[p];
    for (int64_t r = piece->begin; r < piece->end; r += MAX_ROWS) {
      const int64_t* chunk = rows + r;
      auto rows_of_slot = [&](auto& reads) {
        const int64_t rank = ranks[g];
        const float scale = scales[g];
        switch (std::min<int64_t>(MAX_ROWS, piece->end - r)) {
          case 1: slot_rows<1>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, rank, scale, t.data(), reads); break;
          case 2: slot_rows<2>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, rank, scale, t.data(), reads); break;
          case 3: slot_rows<3>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, rank, scale, t.data(), reads); break;
          default: slot_rows<4>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, rank, scale, t.data(), reads); break;
        }
      };
      if (r == piece->begin)
        rows_of_slot(ahead);
      else
        rows_of_slot(cached);
    }
  }
}

void lora_rows_(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const std::vector<at::Tensor>& b,
                const at::Tensor& slots, const at::Tensor& offsets, const at::Tensor& rows, const at::Tensor& ranks,
                const at::Tensor& scales, int64_t prefetch_to) {
  TORCH_CHECK(prefetch_to == 1 || prefetch_to == 2, "lora_rows_: prefetch_to is a cache level, 1 or 2");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "lora_rows_: float32 CPU activations only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "x [rows, in] and y [rows, out] need contiguous rows");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1), "a must be contiguous [slots, wide, in]");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16,
              "lora_rows_: float32 or bfloat16 stacks only");
  TORCH_CHECK(!b.empty() && a.size(1) % static_cast<int64_t>(b.size()) == 0, "a's width is projections * max_rank");
  const int64_t max_rank = a.size(1) / static_cast<int64_t>(b.size());
  std::vector<int64_t> widths;
  int64_t total = 0;
  for (const at::Tensor& bp : b) {
    TORCH_CHECK(bp.dim() == 3 && bp.is_contiguous() && bp.scalar_type() == a.scalar_type() &&
                    bp.size(0) == a.size(0) && bp.size(1) == max_rank,
                "each b must be contiguous [slots, max_rank, out] of a's dtype");
    widths.push_back(bp.size(2));
    total += bp.size(2);
  }
  TORCH_CHECK(y.size(1) == total, "y has ", y.size(1), " columns, the projections ", total);
  const int64_t groups = slots.numel();
  for (const at::Tensor* t : {&slots, &offsets, &rows, &ranks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "slots, offsets, rows and ranks: contiguous int64");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == groups && ranks.numel() == groups &&
                  offsets.numel() == groups + 1, "one scale and rank per group, groups + 1 offsets");
  const int64_t* slot_ids = slots.const_data_ptr<int64_t>();
  const int64_t* rank_of = ranks.const_data_ptr<int64_t>();
  const int64_t* bounds = offsets.const_data_ptr<int64_t>();
  const int64_t* row_ids = rows.const_data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[groups] == rows.numel(), "offsets must span rows");
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(slot_ids[g] >= 0 && slot_ids[g] < a.size(0) && rank_of[g] >= 0 && rank_of[g] <= max_rank &&
                    bounds[g] <= bounds[g + 1], "group ", g, ": slot, rank or offsets out of range");
  }
  std::vector<bool> seen(x.size(0));
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "row ", row_ids[i], " out of range");
    TORCH_CHECK(!seen[row_ids[i]], "row ", row_ids[i], " listed twice");  // the threads' rows must not meet
    seen[row_ids[i]] = true;
  }
  const float* scale_of = scales.const_data_ptr<float>();
  const Stacks st{a.size(2), a.size(1), max_rank, widths};
  auto run = [&](auto weight, auto locality) {
    using W = decltype(weight);
    constexpr int LOCALITY = decltype(locality)::value;
    std::vector<const W*> bs;
    for (const at::Tensor& bp : b) bs.push_back(bp.const_data_ptr<W>());
    const std::vector<Piece> pieces = pieces_of(bounds, groups);
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pieces.size()));
    const std::vector<int64_t> cuts = cuts_of(pieces, rank_of, parts);
    // Pieces write disjoint rows of y (a row is in one group once), so they run in parallel: a run each.
    at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        lora_pieces<W, LOCALITY>(x.const_data_ptr<float>(), x.stride(0), y.mutable_data_ptr<float>(), y.stride(0),
                                 a.const_data_ptr<W>(), bs, st, slot_ids, row_ids, rank_of, scale_of,
                                 pieces.data() + cuts[t], cuts[t + 1] - cuts[t]);
    });
  };
  auto run_at = [&](auto weight) {
    if (prefetch_to == 1)
      run(weight, std::integral_constant<int, 3>{});
    else
      run(weight, std::integral_constant<int, 2>{});
  };
  if (a.scalar_type() == at::kBFloat16)
    run_at(c10::BFloat16{});
  else
    run_at(float{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("lora_rows_(Tensor x, Tensor(a!) y, Tensor a, Tensor[] b, Tensor slots, Tensor offsets, Tensor rows, "
        "Tensor ranks, Tensor scales, int prefetch_to) -> ()");
  m.impl("lora_rows_", c10::DispatchKey::CPU, TORCH_FN(lora_rows_));
}
