// Many-row bfloat16 projections over the panels of panel_linear.cpp, on AMX: oneDNN's batch-reduce
// GEMM micro-kernel (at::native::cpublas::brgemm) with float32 sums.
//
// Registered as torch.ops.tiergate.panel_linear_amx (bfloat16 x, the [panels, in, 16] weight the
// panel kernel reads) and panel_amx_supported. engine/packed_linear.py sends a bfloat16 call here
// when it has many rows (a prefill chunk) and the CPU runs the micro-kernel: the panel kernel's
// AVX-512 sums then are its bound, while AMX's tiles multiply bfloat16 many times faster. A decode
// step (few rows) stays on the panel kernel, which streams the weight at memory speed.
//
// Why oneDNN's micro-kernel: it is kept by Intel and JIT-builds its AMX kernels per shape; torch.mm
// would need the weight as a plain [in, out] tensor (a second copy, or a copy per call) and rounds
// its output to bfloat16 from float32 sums, as this op does.
//
// A thread takes GROUP panels (64 outputs) at a time, copies them side by side ([in, 64]) and packs
// them into oneDNN's VNNI layout in its scratch (256 KB for an input of 2048, within L2), then
// multiplies every block of XROWS rows of x by them; the float32 sums are rounded once to bfloat16
// into the output, as the panel kernel rounds its own.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 16;   // outputs per panel (packed_linear.PANEL)
constexpr int64_t GROUP = 4;    // panels multiplied at once: 64 outputs, the widest B operand oneDNN packs
constexpr int64_t XROWS = 128;  // rows of x per micro-kernel call

bool amx_supported() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor panel_linear_amx(const at::Tensor& x_in, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2,
              "panel_linear_amx: x must be a bfloat16 CPU tensor [rows, in]");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 3 && panels.size(2) == LANES &&
                  panels.is_contiguous() && panels.size(1) == x_in.size(1),
              "panel_linear_amx: panels must be contiguous bfloat16 [panels, in, 16] over x's inputs");
  TORCH_CHECK(out_features > panels.size(0) * LANES - LANES && out_features <= panels.size(0) * LANES,
              "panel_linear_amx: out_features does not match the panels");
  TORCH_CHECK(amx_supported(), "panel_linear_amx: oneDNN's bfloat16 micro-kernel does not run on this CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), npanels = panels.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const c10::BFloat16* xp = x.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = panels.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* outp = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t groups = (npanels + GROUP - 1) / GROUP;
  constexpr int64_t WIDTH = GROUP * LANES;

  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // Zeroed once: a last group of fewer panels multiplies zeros in the columns it lacks.
    std::vector<c10::BFloat16> plain(in * WIDTH, c10::BFloat16(0.f)), packed(in * WIDTH);
    std::vector<float> c(XROWS * WIDTH);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * GROUP, count = std::min(GROUP, npanels - first);
      for (int64_t k = 0; k < in; ++k)
        for (int64_t p = 0; p < count; ++p)
          std::memcpy(&plain[k * WIDTH + p * LANES], wp + ((first + p) * in + k) * LANES, LANES * sizeof(c10::BFloat16));
      at::native::cpublas::pack(in, WIDTH, WIDTH, WIDTH, at::kBFloat16, at::kBFloat16, plain.data(), packed.data());
      const int64_t col0 = first * LANES, cols = std::min(WIDTH, out_features - col0);
      for (int64_t r0 = 0; r0 < rows; r0 += XROWS) {
        const int64_t n = std::min(XROWS, rows - r0);
        at::native::cpublas::brgemm(n, WIDTH, in, in, WIDTH, WIDTH, false, xp + r0 * in, packed.data(), c.data(), true);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t o = 0; o < cols; ++o) outp[(r0 + r) * out_features + col0 + o] = c10::BFloat16(c[r * WIDTH + o]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("panel_linear_amx(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.impl("panel_linear_amx", c10::DispatchKey::CPU, TORCH_FN(panel_linear_amx));
  m.def("panel_amx_supported() -> bool");
  m.impl("panel_amx_supported", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(amx_supported));
}
