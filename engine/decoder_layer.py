"""One decoder layer: its weights, and its forward as two calls, attention then MLP.

A layer reads what its family (engine/families.py) and its place in the model make of it as data
fixed at construction: which norm q and k take (per head, whole, none), which RoPE tables it
rotates with (the global ones, a sliding layer's own, none), whether its inputs are normed
(``pre_norms``) and its outputs (sandwich norms), the residual multiplier, the activation. Nothing
in the forward asks which family it serves.

The residual stream ``h`` is one tensor updated in place through the layers; each block returns
the next block's input: ``h`` normed (the residual add and that norm in one fused pass,
engine/norms.py), or ``h`` itself for a family whose blocks read it as it is (OLMo 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, LayerAttention, paged_attention, rope_decode_attention
from engine.kv_cache import KVCache
from engine.lora_hook import LoraBatchLike
from engine.model_config import ModelConfig
from engine.norms import add_rms_norm_, rms_norm
from engine.packed_linear import Weight, linear, linear_add_rms_norm_
from engine.quant_linear import QuantWeight, StackedQuantWeight, quant_kernels_present
from engine.rope import apply_rope_

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos and sign-folded sin (engine/rope.py)


@dataclass(frozen=True)
class LayerInputs:
    """What every layer of one forward reads beside its own weights."""

    meta: AttentionMetadata
    kv_cache: KVCache
    rope: dict[str, RopeTables]  # by a layer's ``rope_tables``: "global", "local"
    lora: LoraBatchLike | None
    fused: bool  # the fused CPU kernels (norms, RoPE, the SiLU gate) or torch's ops, all together
    # Every row decodes on the CPU's paged kernel, with the fused kernels: a layer whose RoPE is
    # plain makes its rotation, KV write and attention one call (attention.rope_decode_attention),
    # and one whose join is plain adds and norms in its projections' calls where they can.
    fused_decode: bool = False


# Projections are kept transposed, [in, out]: the plain path's torch.mm reads them faster so
# at decode sizes (docs/performance.md), and packing starts from that layout.
class DecoderLayer(nn.Module):
    """One decoder layer's weights, those its family's weight table names, and its forward.
    Projections are stored ``[in, out]`` until ``DecoderModel.prepare_weights`` packs them."""

    qkv: Weight
    o: Weight
    gate_up: Weight
    down: Weight

    def __init__(self, cfg: ModelConfig, index: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        family = cfg.family
        h, qkv, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        full = family.qk_norm_full
        q_norm, k_norm = (cfg.q_size, cfg.kv_size) if full else (cfg.head_dim, cfg.head_dim)
        shapes = {
            "input_norm": (h,), "qkv": (h, qkv), "qkv_bias": (qkv,), "q_norm": (q_norm,), "k_norm": (k_norm,),
            "o": (cfg.q_size, h), "attn_out_norm": (h,), "post_norm": (h,),
            "gate_up": (h, 2 * inter), "down": (inter, h), "mlp_out_norm": (h,),
        }  # fmt: skip
        used = {param for param, _ in family.weights.values()}
        # In the order of the forward: dummy weights (init_random) are drawn in this order.
        for name, shape in shapes.items():
            if name in used:
                self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False))

        self.index = index  # the LoRA hook's and the KV cache's layer
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.qk_size, self.inter = cfg.q_size, cfg.q_size + cfg.kv_size, inter
        self.has_qkv_bias = family.qkv_bias
        self.qk_norm = "head" if family.qk_norm else "whole" if full else None
        self.rope_tables = None if index in cfg.nope_layers else "local" if index in cfg.local_rope_layers else "global"
        self.rotary_dim = cfg.rotary_dim if cfg.rotary_dim < cfg.head_dim else None
        # Whole heads rotated and nothing between the projection and RoPE: rope_decode_attention serves.
        self.plain_rope = self.qk_norm is None and self.rope_tables is not None and self.rotary_dim is None
        self.attn = LayerAttention(cfg.attn_scale or cfg.head_dim**-0.5,
                                   cfg.sliding_window if index in cfg.sliding_layers else None, cfg.attn_logit_softcap)
        self.pre_norms = family.pre_norms
        self.sandwich_norms = family.sandwich_norms
        self.residual_multiplier = cfg.residual_multiplier
        # A block's output added into h as it is and h normed for the next block: the projection may
        # take the add and the norm into its own call (packed_linear.linear_add_rms_norm_).
        self.plain_join = family.pre_norms and not family.sandwich_norms and cfg.residual_multiplier == 1.0
        self.activation = ACTIVATIONS[cfg.activation]
        self.silu_gate = cfg.activation == "silu"  # the fused kernel's gate
        # The layer's decode step as one call of the quantized kernels (csrc/quant_decode_layer.cpp), where
        # ``prepare_decode_call`` found it serves.
        self.decode_call: torch.ScriptObject | None = None
        self.decode_op: Callable[..., torch.Tensor] | None = None

    def prepare_decode_call(self) -> None:
        """Build ``decode_call`` where this layer's whole decode step can be one call: every projection
        quantized with its kernel switches fixed (``QuantWeight.switches``), plain RoPE and residual joins, the
        SiLU gate, no q|k|v bias. The call runs the kernels the separate calls run, in their order."""
        weights = [self.qkv, self.o, self.gate_up, self.down]
        quantized = all(isinstance(w, QuantWeight | StackedQuantWeight) and w.switches is not None for w in weights)
        if not (quantized and self.plain_rope and self.plain_join and self.silu_gate and not self.has_qkv_bias):
            self.decode_call = None
            return
        blocks, types, outs = [], [], []
        for w in weights:
            blocks += w.kernel_args[0]
            types += w.kernel_args[1]
            outs += w.kernel_args[2]
        switches = self.qkv.switches
        # The overload's C++ callable: through ``torch.ops`` an op that takes a torchbind object first walks its
        # arguments in Python for torch.compile's fake objects, at every one of a decode step's thirty-odd calls.
        overload = torch.ops.tiergate.quant_decode_layer_.default
        self.decode_op = getattr(overload, "_op", overload)
        self.decode_call = torch.classes.tiergate.QuantDecodeLayer(
            blocks, types, outs, [len(w.kernel_args[0]) for w in weights], self.post_norm.detach(), self.eps, self.heads,
            self.attn.scale, self.attn.window or 0, self.attn.softcap or 0.0, self.inter, switches.isa,
            switches.row_prefetch)

    def forward(self, x: torch.Tensor, h: torch.Tensor, step: LayerInputs,
                next_norm: torch.Tensor | None) -> torch.Tensor:
        """The layer over ``x`` (its input, ``h`` normed or ``h``), adding into ``h`` in place; returns
        the next layer's input, normed by ``next_norm`` (its input norm; None for the last layer)."""
        # ``prepare_decode_call`` built the call only for plain RoPE and joins; ``fused_decode`` means float32.
        switches = self.qkv.switches if self.decode_call is not None else None
        if (switches is not None and step.fused_decode and step.lora is None and next_norm is not None
                and (switches.panel_rows is None or x.shape[0] < switches.panel_rows)  # else the panels serve
                and quant_kernels_present()):  # as the separate calls check
            return self._decode_in_one_call(x, h, step, next_norm)
        x = self.attention(x, h, step)
        return self.mlp(x, h, step, next_norm)

    def _decode_in_one_call(self, x: torch.Tensor, h: torch.Tensor, step: LayerInputs,
                            next_norm: torch.Tensor) -> torch.Tensor:
        """``forward`` for a step of decodes only, as one call (``prepare_decode_call``)."""
        meta = step.meta.windowed if self.attn.window is not None else step.meta
        cos, sin = step.rope[self.rope_tables]
        return self.decode_op(self.decode_call, x, h, cos, sin, step.kv_cache.layers[self.index], meta.slot_mapping,
                              meta.decode.block_tables, meta.decode.context_lens, next_norm)

    def attention(self, x: torch.Tensor, h: torch.Tensor, step: LayerInputs) -> torch.Tensor:
        """Self-attention over the paged KV cache, added into ``h``; returns the MLP's input."""
        lora, i = step.lora, self.index
        qkv = linear(x, self.qkv)
        if self.has_qkv_bias:
            qkv.add_(self.qkv_bias)
        if lora is not None:
            lora.apply(i, "qkv", x, qkv)
        if step.fused_decode and self.plain_rope:
            attn = rope_decode_attention(qkv, *step.rope[self.rope_tables], step.kv_cache.layers[i], step.meta,
                                         self.attn, self.heads)
        else:
            attn = self._attend(qkv, step)
        return self._project_into(h, attn, self.o, "o", step, self.attn_out_norm if self.sandwich_norms else None,
                                  self.post_norm if self.pre_norms else None)

    def _attend(self, qkv: torch.Tensor, step: LayerInputs) -> torch.Tensor:
        """The fused projection's heads through q/k norms and RoPE, then paged attention: ``[T, heads * d]``."""
        tokens, i = qkv.shape[0], self.index
        heads, head_dim, q_size, qk_size = self.heads, self.head_dim, self.q_size, self.qk_size
        qk = qkv[:, :qk_size].view(tokens, heads + self.kv_heads, head_dim)
        if self.qk_norm == "head":
            qk[:, :heads] = F.rms_norm(qk[:, :heads], (head_dim,), self.q_norm, self.eps)
            qk[:, heads:] = F.rms_norm(qk[:, heads:], (head_dim,), self.k_norm, self.eps)
        elif self.qk_norm == "whole":
            qkv[:, :q_size] = F.rms_norm(qkv[:, :q_size], (q_size,), self.q_norm, self.eps)
            qkv[:, q_size:qk_size] = F.rms_norm(qkv[:, q_size:qk_size], (qk_size - q_size,), self.k_norm, self.eps)
        if self.rope_tables is not None:
            cos, sin = step.rope[self.rope_tables]
            apply_rope_(qk if self.rotary_dim is None else qk[..., :self.rotary_dim], cos, sin, step.fused)
        q = qkv[:, :q_size].view(tokens, heads, head_dim)
        kv = qkv[:, q_size:].view(tokens, 2, self.kv_heads, head_dim)
        return paged_attention(q, kv, step.kv_cache.layers[i], step.meta, self.attn)

    def mlp(self, x: torch.Tensor, h: torch.Tensor, step: LayerInputs, next_norm: torch.Tensor | None) -> torch.Tensor:
        """The gated MLP, added into ``h``; returns the next layer's input (``next_norm``: its norm)."""
        lora, i, inter = step.lora, self.index, self.inter
        gate_up = linear(x, self.gate_up)
        if lora is not None:
            lora.apply(i, "gate_up", x, gate_up)
        if step.fused and self.silu_gate:
            act = torch.ops.tiergate.silu_mul(gate_up, inter)
        else:
            act = self.activation(gate_up[:, :inter]) * gate_up[:, inter:]
        return self._project_into(h, act, self.down, "down", step, self.mlp_out_norm if self.sandwich_norms else None,
                                  next_norm if self.pre_norms else None)

    def _project_into(self, h: torch.Tensor, x: torch.Tensor, weight: Weight, proj: str, step: LayerInputs,
                      out_norm: torch.Tensor | None, next_norm: torch.Tensor | None) -> torch.Tensor:
        """A block's output projection (``x @ weight`` and its adapters' deltas) into the residual stream ``h``
        (scaled, and normed first with ``out_norm``); the next block's input: ``h`` through ``next_norm`` in the
        same pass, or ``h`` itself."""
        lora = step.lora
        if step.fused_decode and self.plain_join and next_norm is not None:
            if lora is not None:  # the adapters' share straight into h, before the base projection's
                lora.apply(self.index, proj, x, h)
            return linear_add_rms_norm_(x, weight, h, next_norm, self.eps)
        out = linear(x, weight)
        if lora is not None:
            lora.apply(self.index, proj, x, out)
        if self.residual_multiplier != 1.0:
            out.mul_(self.residual_multiplier)
        if out_norm is not None:
            out = rms_norm(out, out_norm, self.eps, step.fused)
        if next_norm is not None:
            return add_rms_norm_(h, out, next_norm, self.eps, step.fused)
        return h.add_(out)  # without pre-norms, h itself: read by the next projections before h next changes
