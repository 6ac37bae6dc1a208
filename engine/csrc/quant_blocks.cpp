// The GGUF block formats as tensors: the check every quantized operator runs on its weights, the
// dequantizer to float32 (torch.ops.tiergate.quant_dequantize, the loader's and the tests'
// reference) and which kernel paths this CPU runs (torch.ops.tiergate.quant_isa_supported).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "quant_formats.h"
#include "quant_kernels.h"
#include "quant_packed.h"

#include <cpuid.h>

#include <cstdint>
#include <vector>

namespace tiergate_quant {

void check_blocks(const char* op, const at::Tensor& blocks, int64_t type, int64_t in, int64_t out_features) {
  TORCH_CHECK(known(type), op, ": unknown block format ", type);
  const Format f = format_of(type);
  TORCH_CHECK(in % f.block_values == 0, op, ": the input size ", in, " is not a multiple of ", f.block_values);
  if (blocks.dim() == 3) {
    TORCH_CHECK(repacked(type) && blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                    blocks.is_contiguous() && blocks.size(0) == (out_features + PACK_ROWS - 1) / PACK_ROWS &&
                    blocks.size(1) == in / f.block_values && blocks.size(2) == tile_bytes(type),
                op, ": packed blocks do not match the format, input size and out_features");
    return;
  }
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              op, ": blocks must be a contiguous uint8 CPU tensor [out, bytes_per_row]");
  TORCH_CHECK(blocks.size(0) == out_features && blocks.size(1) == row_bytes_of(type, in), op,
              ": blocks do not match the input size and out_features");
}

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == AVXVNNI) {
    // CPUID leaf 7 sub-leaf 1, EAX bit 4 (GCC 12's __builtin_cpu_supports misses AVX-VNNI).
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __get_cpuid_count(7, 1, &a, &b, &c, &d) &&
           (a >> 4 & 1);
  }
  return isa == SCALAR;
}

}  // namespace tiergate_quant

namespace {

using namespace tiergate_quant;

// Rows of a weight in float32 [rows, in], rounded as ggml's (and gguf-py's) dequantizers round:
// d * q + m, whose product is exact, except Q6_K's d * (q - 32), whose product may round.
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t type, int64_t in) {
  TORCH_CHECK(blocks.dim() == 2, "quant_dequantize: ggml rows [out, bytes_per_row] (unpack a packed weight first)");
  check_blocks("quant_dequantize", blocks, type, in, blocks.size(0));
  const int64_t rows = blocks.size(0), nblocks = in / format_of(type).block_values, n16 = in / 16;
  at::Tensor out = at::empty({rows, in}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(in);
    std::vector<float> d(n16), m(n16);
    for (int64_t r = begin; r < end; ++r) {
      decode_row(type, src + r * blocks.size(1), 0, nblocks, q.data(), d.data(), m.data());
      for (int64_t i = 0; i < in; ++i) {
        if (type == Q6_K)
          dst[r * in + i] = d[i / 16] * float(int(q[i]) - 32);
        else
          dst[r * in + i] = d[i / 16] * (type == Q8_0 ? float(int8_t(q[i])) : float(q[i])) + m[i / 16];
      }
    }
  });
  return out;
}

bool quant_isa_supported(int64_t isa) { return isa_supported(isa); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.def("quant_dequantize(Tensor blocks, int type, int in_features) -> Tensor");
  m.impl("quant_dequantize", c10::DispatchKey::CPU, TORCH_FN(quant_dequantize));
  m.def("quant_isa_supported(int isa) -> bool");
  m.impl("quant_isa_supported", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(quant_isa_supported));
}
