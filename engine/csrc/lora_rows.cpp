// Batched LoRA for rows of many adapters at once on the CPU (punica's BGMV and its prefill form).
//
// Registered as torch.ops.tiergate.lora_rows_, called by lora_pool/ops.py for every row of a step
// that has an adapter: torch would need a gather, two bmms over padded stacks, a cat and an
// index_add per projection group for the decode rows (each a dispatch that costs about what its
// arithmetic does, thirty layers over) and a matmul pair per adapter for the prefill chunks. Here
// one call reads each slot's A and B once per few rows and updates the rows in place, memory-bound
// on the stacks as the bmms were not.
//
// The stacks are lora_pool/ops.py's CPU layout: a [slots, in, projections * max_rank] (the group's
// A side by side along the rank) and b_p [slots, max_rank, out_p] per projection, contiguous, in
// float32 or bfloat16 (half the bytes, widened to float32 as they load; the activations and sums
// stay float32). The rows come grouped by slot: group g is slot slots[g], rows
// rows[offsets[g]:offsets[g + 1]] of x and y, rank ranks[g] (the stack's columns past it are
// zeros and are skipped in the expand) and scale scales[g]. y's columns are the projections'
// outputs side by side.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "simd_lanes.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace tiergate_simd;

// A slot's rows go NR (1 to MAX_ROWS) at a time against NV (1 to MAX_VECS) vectors of columns,
// their sums in registers: in the shrink, each of a's rows is loaded once for the NR rows; in the
// expand, each of b's rows once for the NR rows' y, which stay in registers across the rank.
constexpr int MAX_ROWS = 4, MAX_VECS = 4;

// t[r, j0 : j0 + NV * LANES] = x[rows[r]] @ a[:, those columns], for NR rows.
template <int NR, int NV, typename W>
void shrink_block(const float* const* xr, const W* a, int64_t in, int64_t wide, int64_t j0, float* t) {
  lanes acc[NR][NV] = {};
  for (int64_t i = 0; i < in; ++i) {
    const W* ai = a + i * wide + j0;
    lanes av[NV];
    for (int v = 0; v < NV; ++v) av[v] = load(ai + v * LANES);
    for (int r = 0; r < NR; ++r) {
      const float xv = xr[r][i];
      for (int v = 0; v < NV; ++v) acc[r][v] += xv * av[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) store(t + r * wide + j0 + v * LANES, acc[r][v]);
}

// Calls block(NV, c0) over columns [0, n) in whole vectors, MAX_VECS at a time and then the 1 to 3
// left (NV as a std::integral_constant, for the templates); returns where the columns left to
// scalar code begin.
template <typename Block>
int64_t vector_blocks(int64_t n, Block block) {
  int64_t c0 = 0;
  for (; c0 + MAX_VECS * LANES <= n; c0 += MAX_VECS * LANES) block(std::integral_constant<int, MAX_VECS>{}, c0);
  switch ((n - c0) / LANES) {
    case 3: block(std::integral_constant<int, 3>{}, c0); break;
    case 2: block(std::integral_constant<int, 2>{}, c0); break;
    case 1: block(std::integral_constant<int, 1>{}, c0); break;
    default: break;
  }
  return c0 + (n - c0) / LANES * LANES;
}

template <int NR, typename W>
void shrink_rows(const float* const* xr, const W* a, int64_t in, int64_t wide, float* t) {
  const int64_t tail = vector_blocks(
      wide, [&](auto nv, int64_t j0) { shrink_block<NR, decltype(nv)::value>(xr, a, in, wide, j0, t); });
  for (int64_t j = tail; j < wide; ++j)
    for (int r = 0; r < NR; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < in; ++i) sum += xr[r][i] * static_cast<float>(a[i * wide + j]);
      t[r * wide + j] = sum;
    }
}

// y[rows[r], o0 : o0 + NV * LANES] += tr[r, :rank] @ b[:rank, those columns], for NR rows.
template <int NR, int NV, typename W>
void expand_block(float* const* yr, const float* const* tr, const W* b, int64_t out, int64_t rank, int64_t o0) {
  lanes acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load(yr[r] + o0 + v * LANES);
  for (int64_t j = 0; j < rank; ++j) {
    const W* bj = b + j * out + o0;
    lanes bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load(bj + v * LANES);
    for (int r = 0; r < NR; ++r) {
      const float tv = tr[r][j];
      for (int v = 0; v < NV; ++v) acc[r][v] += tv * bv[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) store(yr[r] + o0 + v * LANES, acc[r][v]);
}

template <int NR, typename W>
void expand_rows(float* const* yr, const float* const* tr, const W* b, int64_t out, int64_t rank) {
  const int64_t tail = vector_blocks(
      out, [&](auto nv, int64_t o0) { expand_block<NR, decltype(nv)::value>(yr, tr, b, out, rank, o0); });
  for (int64_t o = tail; o < out; ++o)
    for (int r = 0; r < NR; ++r) {
      float sum = yr[r][o];
      for (int64_t j = 0; j < rank; ++j) sum += tr[r][j] * static_cast<float>(b[j * out + o]);
      yr[r][o] = sum;
    }
}

struct Stacks {
  int64_t in, wide, max_rank;
  std::vector<int64_t> widths;  // each projection's output columns
};

// NR rows of one slot (rows[0..NR)): shrink, scale, then expand into each projection's columns.
template <int NR, typename W>
void slot_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const W* a_slot,
               const std::vector<const W*>& b_slot, const Stacks& st, const int64_t* rows, int64_t rank, float scale,
               float* t) {
  const float* xr[NR];
  float* yr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + rows[r] * x_stride, yr[r] = y + rows[r] * y_stride;
  shrink_rows<NR>(xr, a_slot, st.in, st.wide, t);
  for (int64_t i = 0; i < NR * st.wide; ++i) t[i] *= scale;
  int64_t col = 0;
  for (size_t p = 0; p < b_slot.size(); ++p) {
    const float* tr[NR];
    float* yc[NR];
    for (int r = 0; r < NR; ++r) tr[r] = t + r * st.wide + p * st.max_rank, yc[r] = yr[r] + col;
    expand_rows<NR>(yc, tr, b_slot[p], st.widths[p], rank);
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

template <typename W>
void lora_pieces(const float* x, int64_t x_stride, float* y, int64_t y_stride, const W* a, const std::vector<const W*>& b,
                 const Stacks& st, const int64_t* slots, const int64_t* rows, const int64_t* ranks, const float* scales,
                 const Piece* pieces, int64_t count) {
  std::vector<float> t(MAX_ROWS * st.wide);
  std::vector<const W*> b_slot(b.size());
  for (const Piece* piece = pieces; piece < pieces + count; ++piece) {
    const int64_t g = piece->group, slot = slots[g];
    const W* a_slot = a + slot * st.in * st.wide;
    for (size_t p = 0; p < b.size(); ++p) b_slot[p] = b[p] + slot * st.max_rank * st.widths[p];
    for (int64_t r = piece->begin; r < piece->end; r += MAX_ROWS) {
      const int64_t* chunk = rows + r;
      switch (std::min<int64_t>(MAX_ROWS, piece->end - r)) {
        case 1: slot_rows<1>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, ranks[g], scales[g], t.data()); break;
        case 2: slot_rows<2>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, ranks[g], scales[g], t.data()); break;
        case 3: slot_rows<3>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, ranks[g], scales[g], t.data()); break;
        default: slot_rows<4>(x, x_stride, y, y_stride, a_slot, b_slot, st, chunk, ranks[g], scales[g], t.data()); break;
      }
    }
  }
}

void lora_rows_(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const std::vector<at::Tensor>& b,
                const at::Tensor& slots, const at::Tensor& offsets, const at::Tensor& rows, const at::Tensor& ranks,
                const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "lora_rows_: float32 CPU activations only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "x [rows, in] and y [rows, out] need contiguous rows");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(1) == x.size(1), "a must be contiguous [slots, in, wide]");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16,
              "lora_rows_: float32 or bfloat16 stacks only");
  TORCH_CHECK(!b.empty() && a.size(2) % static_cast<int64_t>(b.size()) == 0, "a's width is projections * max_rank");
  const int64_t max_rank = a.size(2) / static_cast<int64_t>(b.size());
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
  const Stacks st{a.size(1), a.size(2), max_rank, widths};
  auto run = [&](auto weight) {
    using W = decltype(weight);
    std::vector<const W*> bs;
    for (const at::Tensor& bp : b) bs.push_back(bp.const_data_ptr<W>());
    const std::vector<Piece> pieces = pieces_of(bounds, groups);
    // Pieces write disjoint rows of y (a row is in one group once), so they run in parallel.
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
      lora_pieces<W>(x.const_data_ptr<float>(), x.stride(0), y.mutable_data_ptr<float>(), y.stride(0),
                     a.const_data_ptr<W>(), bs, st, slot_ids, row_ids, rank_of, scale_of, pieces.data() + p0, p1 - p0);
    });
  };
  if (a.scalar_type() == at::kBFloat16)
    run(c10::BFloat16{});
  else
    run(float{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("lora_rows_(Tensor x, Tensor(a!) y, Tensor a, Tensor[] b, Tensor slots, Tensor offsets, Tensor rows, "
        "Tensor ranks, Tensor scales) -> ()");
  m.impl("lora_rows_", c10::DispatchKey::CPU, TORCH_FN(lora_rows_));
}
