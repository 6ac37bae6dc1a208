// Projections on the CPU: y = x @ W for weights stored in panels of 16 outputs.
//
// Registered as torch.ops.tiergate.panel_linear, for float32 (the default) and
// bfloat16 (the opt-in): x, the panels and the output share the dtype, and sums
// accumulate in float32 either way; a bfloat16 weight is widened to float32 in
// registers as it is loaded, so it streams from memory at half the bytes. The weight [in, out] is stored as
// [panels, in, 16]: panel p holds outputs 16p..16p+15, and for each input k their 16
// weights sit side by side, so one vector load brings 16 outputs' weights for one k
// and a panel is one contiguous stretch of memory read front to back. A tile of
// TILE_PANELS panels by up to TILE_ROWS rows of x keeps its sums in registers over
// the whole input: per k, TILE_PANELS weight loads and one broadcast of x per row.
// Decode steps (a few rows) are bound by how fast the weights stream from memory,
// and this layout streams them at the machine's bandwidth; the same tile serves
// prefill chunks. Threads split the panels, each a contiguous share of the weight.
// Between those two, a column of a few row tiles reads its panels from memory in its
// first tile and from cache in the others, so those later tiles prefetch the next
// column and the whole call overlaps memory with arithmetic.
// Written by hand because the libraries at hand either re-pack the weight per call
// (MKL behind torch.mm) or read it slower than memory allows at decode sizes (oneDNN).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "simd_lanes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace tiergate_simd;

// A panel is 16 outputs wide whatever the vector width (packed_linear.py packs them so): one
// register with AVX-512, two with AVX2.
constexpr int64_t PANEL = 16;
constexpr int SPLIT = PANEL / LANES;

// The register budget sets the tile: 32 vector registers with AVX-512, 16 with AVX2.
#if defined(__AVX512F__)
constexpr int TILE_PANELS = 2, TILE_ROWS = 12;
#else
constexpr int TILE_PANELS = 1, TILE_ROWS = 6;
#endif

inline void store(float* dst, const lanes& v, int64_t count) { std::memcpy(dst, &v, count * sizeof(float)); }

inline void store(c10::BFloat16* dst, const lanes& v, int64_t count) {
  for (int64_t l = 0; l < count; ++l) dst[l] = c10::BFloat16(v[l]);  // rounds to nearest even
}

// Columns of up to this many row tiles prefetch the next column while they work: such a
// column's first tile would otherwise wait on memory for weights its later tiles read from cache.
constexpr int64_t PREFETCH_MAX_TILES = 8;

template <typename scalar_t>
struct Operands {
  const scalar_t* panels;  // [num_panels, in, PANEL]
  const scalar_t* x;       // [rows, in], row stride x_stride
  scalar_t* out;           // [rows, out]
  int64_t in, out_features, rows, x_stride;
};

// out[row0 + r][16 * (panel0 + p) + l] for r < ROWS, p < PANELS.
// While it runs, the tile asks for `prefetch_per_k` bytes a k of the weights starting at
// `prefetch` (null: none) to be brought into L2.
template <typename scalar_t, int PANELS, int ROWS>
void tile(const Operands<scalar_t>& o, int64_t panel0, int64_t row0, const char* prefetch, int64_t prefetch_per_k) {
  constexpr int VECS = PANELS * SPLIT;  // vector v is lanes [v % SPLIT * LANES, ...) of panel v / SPLIT
  lanes acc[ROWS][VECS] = {};
  const scalar_t* w = o.panels + panel0 * o.in * PANEL;
  const scalar_t* x = o.x + row0 * o.x_stride;
  for (int64_t k = 0; k < o.in; ++k) {
    if (prefetch) __builtin_prefetch(prefetch + k * prefetch_per_k, 0, 2);
    lanes wk[VECS];
    for (int v = 0; v < VECS; ++v) wk[v] = load(w + (v / SPLIT * o.in + k) * PANEL + v % SPLIT * LANES);
    for (int r = 0; r < ROWS; ++r) {
      const float xk = static_cast<float>(x[r * o.x_stride + k]);
      for (int v = 0; v < VECS; ++v) acc[r][v] += wk[v] * xk;
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) {
      const int64_t first = (panel0 + v / SPLIT) * PANEL + v % SPLIT * LANES;
      const int64_t count = std::min(LANES, o.out_features - first);
      if (count > 0) store(o.out + (row0 + r) * o.out_features + first, acc[r][v], count);
    }
}

// A tile of `rows` (1..ROWS) rows: the row count is a template argument so sums stay in registers.
template <typename scalar_t, int PANELS, int ROWS>
void tile_of(const Operands<scalar_t>& o, int64_t panel0, int64_t row0, int64_t rows, const char* prefetch,
             int64_t prefetch_per_k) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return tile_of<scalar_t, PANELS, ROWS - 1>(o, panel0, row0, rows, prefetch, prefetch_per_k);
  }
  tile<scalar_t, PANELS, ROWS>(o, panel0, row0, prefetch, prefetch_per_k);
}

// Every row against PANELS panels: the panels stay in cache while the rows pass over them.
// Panels [panel0 + PANELS, next_end) follow in this thread's share: the first PANELS of them
// are the next column, which a short column's tiles prefetch, each tile a part.
template <typename scalar_t, int PANELS>
void column(const Operands<scalar_t>& o, int64_t panel0, int64_t next_end) {
  const int64_t tiles = (o.rows + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t next_panels = std::min<int64_t>(PANELS, next_end - panel0 - PANELS);
  const bool prefetching = tiles > 1 && tiles <= PREFETCH_MAX_TILES && next_panels > 0;
  const int64_t next_bytes = next_panels * o.in * PANEL * int64_t(sizeof(scalar_t));
  const char* next = reinterpret_cast<const char*>(o.panels + (panel0 + PANELS) * o.in * PANEL);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t row0 = t * TILE_ROWS;
    const char* prefetch = prefetching ? next + t * next_bytes / tiles : nullptr;
    tile_of<scalar_t, PANELS, TILE_ROWS>(o, panel0, row0, std::min<int64_t>(TILE_ROWS, o.rows - row0), prefetch,
                                         next_bytes / tiles / o.in);
  }
}

template <typename scalar_t>
void multiply_block(const Operands<scalar_t>& o, int64_t num_panels) {
  const int64_t tiles = num_panels / TILE_PANELS;
  if (o.rows == 1) {
    // One row does a single FMA per weight loaded: the call is a pure read of the weight, and a
    // thread reads its share fastest as one stream, panel after panel, not two panels abreast.
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) column<scalar_t, 1>(o, p, end);
    });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) column<scalar_t, TILE_PANELS>(o, t * TILE_PANELS, end * TILE_PANELS);
  });
  for (int64_t p = tiles * TILE_PANELS; p < num_panels; ++p) column<scalar_t, 1>(o, p, num_panels);
}

// Rows go through in blocks of about this many bytes of x: a block stays in L2 while every
// panel passes over it, where all the rows of a long prefill chunk would be read again from L3
// for each panel.
constexpr int64_t ROW_BLOCK_BYTES = 256 * 1024;

template <typename scalar_t>
void multiply(const at::Tensor& x, const at::Tensor& panels, at::Tensor& out) {
  const Operands<scalar_t> o{panels.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                             out.mutable_data_ptr<scalar_t>(), x.size(1), out.size(1), x.size(0), x.stride(0)};
  // Blocks of equal size, whole tiles each: a short last block would run at a few rows' speed.
  const int64_t fit = std::max<int64_t>(TILE_ROWS, ROW_BLOCK_BYTES / (o.in * int64_t(sizeof(scalar_t))));
  const int64_t blocks = (o.rows + fit - 1) / fit;
  const int64_t block_rows = ((o.rows + blocks - 1) / blocks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  for (int64_t row0 = 0; row0 < o.rows; row0 += block_rows) {
    Operands<scalar_t> block = o;
    block.x = o.x + row0 * o.x_stride;
    block.out = o.out + row0 * o.out_features;
    block.rows = std::min(block_rows, o.rows - row0);
    multiply_block(block, panels.size(0));
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear: CPU tensors only");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  panels.scalar_type() == x.scalar_type(),
              "panel_linear: x and the panels must both be float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous(),
              "panels must be a contiguous [panels, in, 16]");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and the weight disagree on the input size");
  TORCH_CHECK(out_features > 0 && out_features <= panels.size(0) * PANEL && out_features > (panels.size(0) - 1) * PANEL,
              "out_features does not fit the panels");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    multiply<float>(x, panels, out);
  else
    multiply<c10::BFloat16>(x, panels, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, TORCH_FN(panel_linear));
}
