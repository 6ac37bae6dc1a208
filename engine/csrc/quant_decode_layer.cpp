// A decoder layer's whole decode step in one call, for a layer on quantized weights: the fused
// q|k|v projection, RoPE with the KV write and paged attention (rope_decode_attention), the output
// projection added into the residual stream and normed (quant_linear_add_rms_norm_), the gate|up
// projection, the SiLU gate (silu_mul) and the down projection added and normed for the next layer.
//
// Registered as torch.ops.tiergate.quant_decode_layer_(layer, x, h, ...), where `layer` is a
// torch.classes.tiergate.QuantDecodeLayer holding the layer's packed weights and constants, built
// once (engine/decoder_layer.py). The same operators run in the same order as the layer's Python
// forward calls them, so the result is the same bits; what goes is the Python between them: at one
// stream's decode step six calls a layer cost more to make than most of them cost to run, and the
// second thread waited through each (docs/performance.md).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace tiergate_quant {

// quant_linear.cpp's and quant_linear_norm.cpp's operators.
at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                        at::IntArrayRef out_features, int64_t isa, bool row_prefetch);
at::Tensor quant_linear_add_rms_norm_(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                                      at::IntArrayRef out_features, int64_t isa, bool row_prefetch,
                                      at::Tensor& residual, const at::Tensor& weight, double eps);

namespace {

// One projection's weights side by side, as quant_linear takes them.
struct Projection {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> types, out_features;
};

struct QuantDecodeLayer : torch::CustomClassHolder {
  // The four projections (q|k|v, o, gate|up, down) flattened: `parts[i]` weights each, in that order.
  QuantDecodeLayer(std::vector<at::Tensor> blocks, std::vector<int64_t> types, std::vector<int64_t> out_features,
                   std::vector<int64_t> parts, at::Tensor post_norm, double eps, int64_t num_heads, double scale,
                   int64_t window, double softcap, int64_t inter, int64_t isa, bool row_prefetch)
      : post_norm(std::move(post_norm)), eps(eps), num_heads(num_heads), scale(scale), window(window),
        softcap(softcap), inter(inter), isa(isa), row_prefetch(row_prefetch) {
    TORCH_CHECK(parts.size() == 4, "QuantDecodeLayer: four projections (qkv, o, gate_up, down)");
    TORCH_CHECK(types.size() == blocks.size() && out_features.size() == blocks.size(),
                "QuantDecodeLayer: one type and one output count per weight");
    size_t at = 0;
    for (size_t p = 0; p < 4; ++p) {
      TORCH_CHECK(parts[p] >= 1 && at + parts[p] <= blocks.size(), "QuantDecodeLayer: parts do not match the weights");
      for (int64_t i = 0; i < parts[p]; ++i, ++at) {
        projections[p].blocks.push_back(blocks[at]);
        projections[p].types.push_back(types[at]);
        projections[p].out_features.push_back(out_features[at]);
      }
    }
    TORCH_CHECK(at == blocks.size(), "QuantDecodeLayer: parts do not match the weights");
  }

  Projection projections[4];
  at::Tensor post_norm;
  double eps;
  int64_t num_heads;
  double scale;
  int64_t window;
  double softcap;
  int64_t inter, isa;
  bool row_prefetch;
};

at::Tensor project(const QuantDecodeLayer& l, int which, const at::Tensor& x) {
  const Projection& p = l.projections[which];
  return quant_linear(x, p.blocks, p.types, p.out_features, l.isa, l.row_prefetch);
}

at::Tensor project_add_norm_(const QuantDecodeLayer& l, int which, const at::Tensor& x, at::Tensor& h,
                             const at::Tensor& norm) {
  const Projection& p = l.projections[which];
  return quant_linear_add_rms_norm_(x, p.blocks, p.types, p.out_features, l.isa, l.row_prefetch, h, norm, l.eps);
}

// paged_attention.cpp and pointwise.cpp build into the other extension: reached through the dispatcher.
at::Tensor rope_decode_attention(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t num_heads, double scale, int64_t window,
                                 double softcap) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tiergate::rope_decode_attention", "")
                             .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               double, int64_t, double)>();
  return op.call(qkv, cos, sin, kv_cache, slot_mapping, block_tables, context_lens, num_heads, scale, window, softcap);
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tiergate::silu_mul", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(gate_up, inter);
}

// h (the residual stream) is added to in place; returns the next layer's input, h normed by next_norm.
at::Tensor quant_decode_layer_(const c10::intrusive_ptr<QuantDecodeLayer>& layer, const at::Tensor& x, at::Tensor& h,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& next_norm) {
  const QuantDecodeLayer& l = *layer;
  at::Tensor qkv = project(l, 0, x);
  const at::Tensor attn = rope_decode_attention(qkv, cos, sin, kv_cache, slot_mapping, block_tables, context_lens,
                                                l.num_heads, l.scale, l.window, l.softcap);
  const at::Tensor mlp_in = project_add_norm_(l, 1, attn, h, l.post_norm);
  const at::Tensor act = silu_mul(project(l, 2, mlp_in), l.inter);
  return project_add_norm_(l, 3, act, h, next_norm);
}

}  // namespace
}  // namespace tiergate_quant

TORCH_LIBRARY_FRAGMENT(tiergate, m) {
  m.class_<tiergate_quant::QuantDecodeLayer>("QuantDecodeLayer")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       at::Tensor, double, int64_t, double, int64_t, double, int64_t, int64_t, bool>());
  m.def("quant_decode_layer_(__torch__.torch.classes.tiergate.QuantDecodeLayer layer, Tensor x, Tensor(a!) h, "
        "Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
        "Tensor next_norm) -> Tensor");
  m.impl("quant_decode_layer_", c10::DispatchKey::CPU, TORCH_FN(tiergate_quant::quant_decode_layer_));
}
