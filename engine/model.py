"""The native decoder model over a paged KV cache: its weights' loading and form, the embedding,
the layers in turn (engine/decoder_layer.py: each one's attention and MLP, one code path for every
served family), the final norm and the LM head.

Rows are the step's tokens, flattened in plan order with no padding. q/k/v and
gate/up are fused into one weight each at load time so each is one matmul;
LoRA deltas are added to the fused outputs, one hook call per fused group, through
the ``LoraBatchLike`` hook. The LM head runs only on the rows that sample.
Projections and the head go through ``engine.packed_linear`` (packed weights and
a CPU kernel on CPU, ``torch.mm`` elsewhere): ``prepare_weights`` puts them in that form.
What a family adds to Llama (biases, q/k norms, sandwich norms, soft-caps, sliding
windows, weight names) comes from its ``engine.families.Family`` and ``ModelConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.decoder_layer import DecoderLayer, LayerInputs
from engine.families import NORMS
from engine.kv_cache import KVCache
from engine.lora_hook import LoraBatchLike
from engine.model_config import ModelConfig
from engine.norms import fused_norms_available, rms_norm
from engine.packed_linear import PackedWeight, Weight, linear, pack, panel_storage, release_freed_heap, weight_form
from engine.quant_linear import (QUANTIZE_KINDS, QuantWeight, StackedQuantWeight, kernel_switches,
                                 quant_kernels_present, quantize_weight)
from engine.rope import Rope


# Below this many sampled rows the unpacked CPU LM head uses its transposed copy (see prepare_weights).
LM_HEAD_TRANSPOSED_MAX_ROWS = 24
# A layer's projection weights, in the order of the forward.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _text_model_name(name: str) -> str:
    """A checkpoint tensor's name inside the decoder: without ``model.``, and for image-text
    checkpoints (Gemma 3) without their text model's ``language_model.`` prefix, in either of
    transformers' layouts (``language_model.model.X`` and ``model.language_model.X``)."""
    return name.removeprefix("language_model.").removeprefix("model.").removeprefix("language_model.")


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype), requires_grad=False)
        self.family = cfg.family
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, device=device, dtype=dtype), requires_grad=False)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype), requires_grad=False)
        # The head as the forward multiplies it: packed, or a transposed copy on CPU (see prepare_weights).
        self.head: Weight | None = None
        # Whether the forward's norms run on the fused CPU kernels (engine/norms.py); set with the weights' form.
        self.fused_norms = False
        self.rope = Rope(cfg, device)
        self.local_rope = None if cfg.local_rope_theta is None else Rope(
            replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), device)
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self._slices = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}

    # The final norm, never packed, says where the model is and what it computes in.
    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], projections: bool = True) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be covered.

        ``projections=False``: only norms and biases are expected (``load_packed_weights`` sets the rest)."""
        expected = {f"layers.{i}.{s}" for i in range(self.cfg.num_layers) for s in self.family.weights
                    if projections or self.family.weights[s][0] not in PROJECTIONS}
        expected.add("norm.weight")
        if projections:
            expected |= {"embed_tokens.weight"} | ({"lm_head.weight"} if not self.cfg.tie_word_embeddings else set())
        seen: set[str] = set()
        for name, tensor in weights:
            name = _text_model_name(name)
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name not in expected:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            seen.add(name)
            target, is_norm = self._param_slice(name)
            target.copy_(tensor.T if target.dim() == 2 and name.startswith("layers.") else tensor)
            if is_norm and self.family.norm_offset:
                target.add_(self.family.norm_offset)
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def load_packed_weights(self, embed: Weight, head: Weight | None, projections: list[dict[str, Weight]],
                            floats: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights that come in their serving form (a GGUF's quantized tensors, engine/gguf_weights.py):
        ``projections`` per layer by name, each a ``PackedWeight`` kept as it is or a plain ``[in, out]``
        tensor copied in (``prepare_weights`` packs it); ``embed`` a ``PackedWeight`` whose outputs are
        the vocabulary (rows dequantized on lookup; a tied head is the same weight) or a plain
        ``[vocab, hidden]`` tensor; ``head`` likewise, None when tied; norms and biases as ``load_weights``."""
        self.load_weights(floats, projections=False)
        for layer, weights in zip(self.layers, projections, strict=True):
            for name in PROJECTIONS:
                self._set_weight(layer, name, weights[name])
        tied = self.cfg.tie_word_embeddings
        if isinstance(embed, PackedWeight):
            del self.embed  # drops the Parameter and with it its buffer (never written, so never resident)
            self.embed = embed
            if tied:
                del self.lm_head
                self.lm_head, self.head = None, embed
        else:
            self.embed.data.copy_(embed)
        if head is not None:
            if isinstance(head, PackedWeight):
                del self.lm_head
                self.lm_head, self.head = None, head
            else:
                self.lm_head.data.copy_(head)

    @staticmethod
    def _set_weight(layer: nn.Module, name: str, weight: Weight) -> None:
        if isinstance(weight, PackedWeight):
            delattr(layer, name)
            setattr(layer, name, weight)
        else:
            getattr(layer, name).data.copy_(weight)

    def quantize_projections(self, kind: str) -> None:
        """Every projection quantized into the block format ``kind`` (``--quantize``: q8_0, q4_0, q4_k),
        blocks along its inputs; a fused weight is quantized whole, as each output's blocks are its own.
        The embedding, the head, norms and biases stay float."""
        block = gguf.GGML_QUANT_SIZES[QUANTIZE_KINDS[kind]][0]
        for i, layer in enumerate(self.layers):
            for name in PROJECTIONS:
                weight = getattr(layer, name)
                if isinstance(weight, PackedWeight):
                    raise ValueError(f"layer {i} {name} is packed already ({weight.form}): quantize before packing")
                if weight.shape[0] % block:
                    raise ValueError(f"--quantize {kind} needs every projection's input size to be a multiple of "
                                     f"{block}; layer {i} {name} has {weight.shape[0]}")
                self._set_weight(layer, name, quantize_weight(weight.detach(), kind))
        release_freed_heap()

    def _param_slice(self, name: str) -> tuple[torch.Tensor, bool]:
        """Where the HF tensor ``name`` goes, and whether it is an RMSNorm weight."""
        if name == "embed_tokens.weight":
            return self.embed.data, False
        if name == "norm.weight":
            return self.norm.data, True
        if name == "lm_head.weight":
            return self.lm_head.data, False
        _, index, suffix = name.split(".", 2)
        attr, part = self.family.weights[suffix]
        param = getattr(self.layers[int(index)], attr).data
        if part is None:
            return param, attr in NORMS
        lo, hi = self._slices[part]
        return param[..., lo:hi], False

    def init_random(self, seed: int) -> None:
        """Random weights in place (HF's init: normal(0, 0.02), norms at one) for dummy loading."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm"):
                param.data.fill_(1.0)
            elif name.endswith("bias"):
                param.data.zero_()
            else:
                param.data.normal_(0.0, 0.02, generator=gen)

    @property
    def is_packed(self) -> bool:
        return isinstance(self.head, PackedWeight)

    @property
    def weight_form(self) -> str:
        """The form the head is in now: ``panels``, ``onednn``, ``quant`` or ``plain`` (engine/packed_linear.py,
        engine/quant_linear.py)."""
        return self.head.form if isinstance(self.head, PackedWeight) else "plain"

    def _served_weights(self) -> list[Weight]:
        """The embedding, the head (None until prepare_weights gives it a form) and every projection."""
        return [self.embed, self.head] + [getattr(layer, name) for layer in self.layers for name in PROJECTIONS]

    def weight_forms(self) -> set[str]:
        """The forms of every projection, the embedding and the head (``plain`` for a tensor)."""
        return {w.form if isinstance(w, PackedWeight) else "plain" for w in self._served_weights() if w is not None}

    def weight_bytes(self) -> int:
        """Bytes the weights hold (a tied head counted once; a plain head's transposed copy counted)."""
        weights = {id(w): w for w in [self.embed, self.head, self.lm_head, self.norm, *self.layers.parameters(),
                                      *(getattr(layer, name) for layer in self.layers for name in PROJECTIONS)]
                   if w is not None}
        return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in weights.values())

    def prepare_weights(self) -> None:
        """Put projections and the head in the form the forward reads on this device and dtype.

        Where ``weight_form`` packs, every projection and the head are packed and their
        plain copies dropped (a tied head keeps the embedding, which the lookup needs).
        Otherwise the head on CPU gets a transposed copy, faster for decode-sized row
        counts, beside the plain one. ``ModelRunner`` calls it once the model is on its
        device, after loading has let go of its buffers: packing inside the load raised the
        process's peak RSS. Call ``unpack_weights`` before moving the model.
        """
        self.fused_norms = fused_norms_available(self.device, self.dtype)
        self._fix_kernel_switches()
        form = weight_form(self.device, self.dtype)
        if form == "plain":
            if self.head is None and self.device.type == "cpu":
                self.head = self.lm_head.detach().t().contiguous()
            return
        for layer in self.layers:
            # Weights that came packed (a GGUF's quantized ones) stay as they are.
            names = [name for name in PROJECTIONS if not isinstance(getattr(layer, name), PackedWeight)]
            weights = [getattr(layer, name).detach() for name in names]
            # A layer's panels side by side, so huge pages cover them all (packed_linear.panel_storage).
            storage = panel_storage([w.shape for w in weights], self.dtype) if form == "panels" and names else [None] * len(names)
            for name, weight, out in zip(names, weights, storage):
                packed = pack(weight, form, out)
                delattr(layer, name)  # drops the Parameter, and with it the plain copy
                setattr(layer, name, packed)
            del weights
        if not isinstance(self.head, PackedWeight):
            self.head = pack(self.lm_head.detach().t(), form)
            if not self.cfg.tie_word_embeddings:
                del self.lm_head
                self.lm_head = None
        release_freed_heap()

    def _fix_kernel_switches(self) -> None:
        """The quantized weights' kernel switches, read here once (``QuantWeight.switches``), and each layer's
        one-call decode step built on them (``DecoderLayer.prepare_decode_call``)."""
        if not quant_kernels_present():
            return
        switches = kernel_switches()
        for weight in self._served_weights():
            if isinstance(weight, QuantWeight | StackedQuantWeight):
                weight.switches = switches
        for layer in self.layers:
            layer.prepare_decode_call()

    def unpack_weights(self) -> None:
        """Plain ``[in, out]`` Parameters again, as loaded: for moving the model or reading weights."""
        if self.weight_forms() == {"plain"}:
            return
        for layer in self.layers:
            layer.decode_call = None  # it holds the packed weights
            for name in PROJECTIONS:
                weight = getattr(layer, name)
                if isinstance(weight, PackedWeight):
                    delattr(layer, name)
                    setattr(layer, name, nn.Parameter(weight.dense(), requires_grad=False))
        if isinstance(self.embed, PackedWeight):
            self.embed = nn.Parameter(self.embed.dense().t().contiguous(), requires_grad=False)
            if self.cfg.tie_word_embeddings:
                self.lm_head = self.embed
        if self.lm_head is None:
            self.lm_head = nn.Parameter(self.head.dense().t().contiguous(), requires_grad=False)
        self.head = None

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final-normed hidden states (``final_hidden``)."""
        cfg = self.cfg
        if isinstance(self.head, PackedWeight) or (self.head is not None and hidden.shape[0] < LM_HEAD_TRANSPOSED_MAX_ROWS):
            logits = linear(hidden, self.head).float()
        else:
            logits = F.linear(hidden, self.lm_head).float()
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rows: torch.Tensor,
        lora: LoraBatchLike | None = None,
        long_rows: torch.Tensor | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The last layer's hidden states of ``rows``, through the final norm: ``[len(rows), hidden]``.

        ``long_rows`` (LongRoPE models only): bool ``[T]``, the rows of sequences in the long regime.
        ``between_layers`` is called after every layer but the last; it may run a whole forward
        of its own (an express step, engine/step_loop.py), since this one's state is all local."""
        cfg, fused = self.cfg, self.fused_norms
        tables = self.rope.tables(positions, self.dtype, long_rows)
        local_tables = tables if self.local_rope is None else self.local_rope.tables(positions, self.dtype)
        step = LayerInputs(meta, kv_cache, {"global": tables, "local": local_tables}, lora, fused,
                           fused_decode=fused and meta.decode_only and meta.decode.kernel is not None)
        h = self.embed.dequantize_rows(input_ids) if isinstance(self.embed, PackedWeight) else F.embedding(input_ids, self.embed)
        if self.family.embed_scale:
            h = h * torch.tensor(cfg.hidden_size**0.5, dtype=h.dtype)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        # h, the residual stream, is added to in place; x is each layer's input (h normed, or h).
        pre_norms, last = self.family.pre_norms, len(self.layers) - 1
        # A step of decodes has a plain-joined last layer add into h and apply the final norm in one pass,
        # as the others do the next layer's norm (the same row norm: the bits of norming h[rows] after it).
        norm_in_last = step.fused_decode and self.layers[-1].plain_join
        x = rms_norm(h, self.layers[0].input_norm, cfg.rms_norm_eps, fused) if pre_norms else h
        for i, layer in enumerate(self.layers):
            next_norm = None
            if pre_norms:
                next_norm = self.layers[i + 1].input_norm if i < last else self.norm if norm_in_last else None
            x = layer(x, h, step, next_norm)
            if between_layers is not None and i < last:
                between_layers()
        if norm_in_last:
            return x[rows]
        return rms_norm(h[rows], self.norm, cfg.rms_norm_eps, fused)
