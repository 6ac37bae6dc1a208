"""Tiny random-weight Llama GGUF files in the block formats llama.cpp writes, for the native loading tests.

Tensors of a type gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are float weights quantized by
it; the K-types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), which gguf-py only dequantizes, get valid random blocks:
random quants and sub-scales, finite f16 super-block scales where ggml keeps them, weights centred on zero. q and k
rows are whatever the file holds: the loader's row permutation is checked against the dequantized
path, which undoes it the way transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# K-types' super-block scale d (f16 at byte 0, or 208 for Q6_K) near a value that keeps weights near 0.05.
K_SCALE = {Q.Q4_K: 7e-4, Q.Q5_K: 3.5e-4, Q.Q6_K: 5e-5}
# Types tiergate has no kernel for (dequantized at load): where their f16 super-block scales sit, and a d
# near which weights stay near 0.05. Q3_K is symmetric with signed sub-scales (random bytes are centred);
# Q2_K's dmin at 82 is set to d times its mean sub-scale times mean quant, about centring it.
UNSERVED_K = {Q.Q2_K: (80, 1e-3), Q.Q3_K: (108, 1.5e-3)}
Q2_K_MEAN = 7.5 * 1.5
# Q4_K and Q5_K: the mean of their unsigned quants, which the block's min (dmin * m) is set to cancel.
K_MEAN_QUANT = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}
VOCAB = 320
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TinyShape:
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    tied: bool = True


@dataclass(frozen=True)
class TensorTypes:
    """The type of each projection (by llama.cpp name, ``attn_v``, or one layer's, ``1.attn_v``), the
    embedding's and the head's (untied files)."""

    projections: dict[str, Q] = field(default_factory=dict)
    default: Q = Q.Q8_0
    embed: Q = Q.Q8_0
    head: Q = Q.Q6_K

    def of(self, layer: int, projection: str) -> Q:
        return self.projections.get(f"{layer}.{projection}", self.projections.get(projection, self.default))


def uniform(kind: Q, embed: Q | None = None) -> TensorTypes:
    return TensorTypes(default=kind, embed=embed or kind, head=kind)


SERVED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Every served type in every position of a fused group over two layers (q|k|v and gate|up of mixed types).
EVERY_SERVED = TensorTypes(projections={f"{layer}.{proj}": SERVED[(i + 3 * layer) % len(SERVED)]
                                        for layer in range(2) for i, proj in enumerate(PROJECTIONS)},
                           embed=Q.Q4_1, head=Q.Q5_K)
# llama.cpp's Q4_K_M mix: v and down in Q6_K, the rest Q4_K, the head in Q6_K.
Q4_K_M = TensorTypes(projections={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}, default=Q.Q4_K, embed=Q.Q4_K, head=Q.Q6_K)


def quantized(weight: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """``weight`` [rows, cols] as ``kind``'s bytes (gguf-py's quantizer), or random valid K-type blocks."""
    if kind == Q.F32:
        return weight.astype(np.float32)
    if kind not in K_SCALE and kind not in UNSERVED_K:
        return gguf.quants.quantize(weight.astype(np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = weight.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if kind in UNSERVED_K:
        at, scale = UNSERVED_K[kind]
        d = (scale * rng.uniform(0.5, 1.5, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., at:at + 2] = f16_bytes(d)
        if kind == Q.Q2_K:
            blocks[..., 82:84] = f16_bytes((d.astype(np.float32) * Q2_K_MEAN).astype(np.float16))
        return blocks.reshape(rows, -1)
    d = (K_SCALE[kind] * rng.uniform(0.5, 1.5, size=blocks.shape[:2])).astype(np.float16)
    if kind == Q.Q6_K:  # symmetric quants (q - 32) and signed sub-scales: random bytes are centred already
        blocks[..., 208:210] = f16_bytes(d)
        return blocks.reshape(rows, -1)
    # Sub-scales s_j and mins m_j equal, in 1..15 (so the 6-bit packing keeps them in its low bits):
    # with dmin = d * mean quant, each sub-block's weights d * s_j * (q - mean) are centred on zero,
    # as a trained model's are, instead of all positive.
    sub = rng.integers(1, 16, size=(*blocks.shape[:2], 8), dtype=np.uint8)
    blocks[..., 4:8], blocks[..., 8:12] = sub[..., :4], sub[..., :4]
    blocks[..., 12:16] = sub[..., 4:] | (sub[..., 4:] << 4)
    blocks[..., 0:2] = f16_bytes(d)
    blocks[..., 2:4] = f16_bytes((d.astype(np.float32) * K_MEAN_QUANT[kind]).astype(np.float16))
    return blocks.reshape(rows, -1)


def f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def write_tiny_gguf(out: Path, types: TensorTypes, shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    """A Llama-architecture GGUF with random weights of ``types``, a word-level token list and its metadata."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    writer.add_context_length(512)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, weight: np.ndarray, kind: Q) -> None:
        data = quantized(weight, kind, rng)
        if kind == Q.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    head_dim = shape.hidden // shape.heads
    outs = {"attn_q": shape.hidden, "attn_k": shape.kv_heads * head_dim, "attn_v": shape.kv_heads * head_dim,
            "attn_output": shape.hidden, "ffn_gate": shape.intermediate, "ffn_up": shape.intermediate,
            "ffn_down": shape.hidden}
    ins = {**{p: shape.hidden for p in outs}, "ffn_down": shape.intermediate}
    add("token_embd.weight", normal(VOCAB, shape.hidden, 0.5), types.embed)
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.2 * rng.standard_normal(shape.hidden)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.2 * rng.standard_normal(shape.hidden)).astype(np.float32))
        for proj in PROJECTIONS:
            add(f"blk.{i}.{proj}.weight", normal(outs[proj], ins[proj], 0.05), types.of(i, proj))
    writer.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(shape.hidden)).astype(np.float32))
    if not shape.tied:
        add("output.weight", normal(VOCAB, shape.hidden, 0.1), types.head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
