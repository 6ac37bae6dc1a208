"""Random-weight GGUFs of larger Llama shapes for the quantized-serving bench, quantized by llama.cpp.

Only one real model ships with tiergate (SmolLM2-135M, Q4_1); a quantized decode step's speed
depends on the weights' bytes and shapes, not their values, so the bench builds Llama-shaped files
of ~360M and ~1B parameters from the bundled file's metadata and tokenizer, with F16 weights drawn
from a seeded normal(0, 0.02) (norms at 1: each layer's output stays of order one, so logits are
spread, not degenerate), then quantizes them with llama.cpp's own quantizer
(``llama_model_quantize``, its default parameters), as a user's Q8_0, Q4_0, Q4_K_M or Q5_K_M file is made.
Files are written once into the bench cache (bench/common/model_files.py's ``cache_dir``).

    .venv/bin/python -m bench.common.gguf_shapes [--models 360m,1b] [--quants q8_0,q4_0,q4_k_m,q5_k_m]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.common import model_files

WEIGHT_STD = 0.02


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensor_shapes(self, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor, numpy shape ``(out, in)`` as gguf-py writes it; the embedding is tied (no
        ``output.weight``), as in SmolLM2 and Llama 3.2 1B."""
        kv = self.kv_heads * self.head_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, self.hidden))]
        for i in range(self.layers):
            shapes += [
                (f"blk.{i}.attn_norm.weight", (self.hidden,)),
                (f"blk.{i}.attn_q.weight", (self.hidden, self.hidden)),
                (f"blk.{i}.attn_k.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_output.weight", (self.hidden, self.hidden)),
                (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                (f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden)),
                (f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden)),
                (f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn)),
            ]
        return shapes + [("output_norm.weight", (self.hidden,))]

    def parameters(self, vocab: int) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensor_shapes(vocab))


SHAPES = {
    "360m": LlamaShape("360m", hidden=960, layers=32, heads=15, kv_heads=5, ffn=2560),  # SmolLM2-360M
    "1b": LlamaShape("1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),  # Llama 3.2 1B
}

# llama.cpp's file types by the names users know them by (llama_ftype in llama.h).
QUANTS = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
          "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}

# Keys of the bundled file the shape replaces (or that gguf-py writes itself).
_SHAPE_KEYS = {"block_count", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "rope.dimension_count"}


def _copied_fields(reader: gguf.GGUFReader, arch: str):
    """(key, value, type, sub_type) of the bundled file's metadata the random model keeps: tokenizer,
    rope base, norm epsilon, context length, vocabulary size, chat template."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.name",
                                              "general.size_label", "general.basename", "general.finetune"):
            continue
        if key.removeprefix(f"{arch}.") in _SHAPE_KEYS:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        yield key, field.contents(), vtype, sub_type


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])  # per tensor: the values do not depend on write order
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= WEIGHT_STD
    return values.astype(np.float16)


def write_random_gguf(shape: LlamaShape, dst: Path, template: Path, seed: int = 0) -> Path:
    """An F16 GGUF of ``shape`` with seeded random weights and ``template``'s tokenizer and metadata.

    Tensors are streamed to the file one at a time (gguf-py's writer otherwise holds them all:
    2 GB at 1B)."""
    reader = gguf.GGUFReader(template)
    arch = reader.fields["general.architecture"].contents()
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(f"tiergate bench random {shape.name}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    for key, value, vtype, sub_type in _copied_fields(reader, arch):
        writer.add_key_value(key, value, vtype, sub_type)
    tensors = shape.tensor_shapes(vocab)
    for name, dims in tensors:
        dtype = np.float32 if name.endswith("norm.weight") else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, dims) in enumerate(tensors):
        writer.write_tensor_data(_random_tensor(name, dims, seed, index))
    writer.close()
    tmp.rename(dst)
    return dst


def quantize(src: Path, dst: Path, quant: str, threads: int = 0) -> Path:
    """``src`` quantized to ``quant`` (a key of QUANTS) by llama.cpp's own quantizer, default parameters."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTS[quant])
    params.nthread = threads
    tmp = dst.with_suffix(".tmp")
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src.name}, {quant}) returned {status}")
    tmp.rename(dst)
    return dst


def random_gguf(model: str, quant: str, seed: int = 0) -> Path:
    """The cached random-weight GGUF of ``model`` (a key of SHAPES) in ``quant``, built on first use."""
    if model not in SHAPES:
        raise ValueError(f"unknown model shape {model!r}; choose from {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose from {', '.join(QUANTS)}")
    folder = model_files.cache_dir() / "random-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / f"random-{model}-s{seed}.{quant.upper()}.gguf"
    if not dst.exists():
        src = folder / f"random-{model}-s{seed}.F16.gguf"
        if not src.exists():
            print(f"gguf_shapes: writing {src.name}", file=sys.stderr, flush=True)
            write_random_gguf(SHAPES[model], src, model_files.bundled_gguf(), seed)
        print(f"gguf_shapes: quantizing {src.name} to {quant}", file=sys.stderr, flush=True)
        quantize(src, dst, quant)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.common.gguf_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--quants", default=",".join(QUANTS))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for model in args.models.split(","):
        for quant in args.quants.split(","):
            path = random_gguf(model, quant)
            print(f"{model} {quant}: {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
