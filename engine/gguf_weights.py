"""A GGUF file's tensors as the model's weights, kept in the file's own quantization.

Where each tensor lies is read once by gguf-py's ``GGUFReader`` and kept in a small table beside the
cached config (its metadata parse takes seconds); a start maps the file read-only and takes the
tensors' bytes in place. Nothing is dequantized that a kernel of ``engine.quant_linear`` can
multiply as it is stored. Each tensor is found under the llama.cpp name
that gguf-py's own table (``gguf.get_tensor_name_map``) gives the checkpoint name our family's
weight table uses, as transformers' GGUF loader finds them, and undergoes the same fix-ups that
loader applies per architecture, so the served weights are the reference's values:

- ``llama``: llama.cpp's converter interleaves each q and k head's two rotary halves; undone here
  as a permutation of whole rows, which in a quantized tensor are whole runs of blocks.
- ``gemma2``/``gemma3``: norms are stored as ``1 + w``; transformers subtracts the one (and the
  model adds it back), done here in the same float32 steps so the values are the reference's bits.

Projections (q|k|v, o, gate|up, down) become ``QuantWeight``s, a fused group through
``stack_outputs``; the token embedding stays quantized (rows dequantized on lookup), and a tied
head is that same weight. Norms and biases are float32. A tensor whose type has no kernel is
dequantized here, with one warning naming the tensors and the types.

Weights repacked at load (``engine.quant_linear.REPACKED_TYPES``) are copies; as each is made, the
map's pages of its tensor are let go (``madvise(MADV_DONTNEED)``), and after the last the whole map's,
so the weights count once in the process's RSS, during the load too: what is still read in place (an
embedding's rows) is paged in again on use.
"""

from __future__ import annotations

import json
import mmap
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.model_config import ModelConfig
from engine.packed_linear import PackedWeight, Weight
from engine.quant_linear import SERVED_TYPES, QuantWeight, stack_outputs

# Architectures whose q/k rows llama.cpp's converter permutes (transformers undoes it for these).
PERMUTED_QK_ARCHS = frozenset({"llama"})
# Architectures whose norm weights are stored with Gemma's one added.
NORM_PLUS_ONE_ARCHS = frozenset({"gemma2", "gemma3"})
# Float tensor types: read as float32 (they are the float form already, no kernel is missing).
FLOAT_TYPES = frozenset({gguf.GGMLQuantizationType.F32})
# A fused projection's parts in output order (engine/model.py fuses them the same way).
GROUP_PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


@dataclass
class GgufWeights:
    """What ``DecoderModel.load_gguf_weights`` takes: the file's weights in the model's forms."""

    embed: Weight  # QuantWeight [in=hidden, out=vocab], or float32 [vocab, hidden]
    head: Weight | None  # None when the embedding is tied; QuantWeight, or float32 [vocab, hidden]
    projections: list[dict[str, Weight]]  # per layer: qkv, o, gate_up, down (QuantWeight or float [in, out])
    floats: list[tuple[str, torch.Tensor]]  # norms and biases, under their checkpoint names
    dequantized: dict[str, list[str]] = field(default_factory=dict)  # type name -> tensors without a kernel
    types: dict[str, int] = field(default_factory=dict)  # type name -> tensors of it in the file read

    @property
    def quant_bytes(self) -> int:
        """Bytes of every weight kept quantized (shared ones once)."""
        seen = {id(w): w for w in self._all() if isinstance(w, PackedWeight) and w.form == "quant"}
        return sum(w.nbytes for w in seen.values())

    def _all(self) -> Iterator[Weight]:
        yield self.embed
        if self.head is not None:
            yield self.head
        for layer in self.projections:
            yield from layer.values()


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the file as gguf-py reads it: its bytes are ``data`` (a view of the mapped file)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the row length first
    data: np.ndarray
    offset: int  # of its first byte in the file (and the map)


def write_tensor_table(reader: gguf.GGUFReader, out: Path) -> None:
    """Where each tensor of the GGUF ``reader`` parsed lies, saved to ``out``: parsing the file's metadata
    (its token lists above all) takes seconds, reading this takes none."""
    table = {"architecture": str(reader.fields["general.architecture"].contents()),
             "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
                          "offset": int(t.data_offset), "dtype": t.data.dtype.str, "dims": list(t.data.shape)}
                         for t in reader.tensors]}
    out.write_text(json.dumps(table))


def read_tensor_table(path: Path, table_file: Path) -> tuple[str, dict[str, FileTensor]]:
    """The file's architecture and tensors, mapped read-only at the places ``write_tensor_table`` saved."""
    table = json.loads(table_file.read_text())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for t in table["tensors"]:
        dtype = np.dtype(t["dtype"])
        size = int(np.prod(t["dims"])) * dtype.itemsize
        data = mapped[t["offset"]:t["offset"] + size].view(dtype).reshape(t["dims"])
        tensors[t["name"]] = FileTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), tuple(t["shape"]), data,
                                        t["offset"])
    return table["architecture"], tensors


def read_gguf_weights(path: Path, config: ModelConfig, table_file: Path) -> GgufWeights:
    """The weights of the GGUF at ``path`` for the model ``config`` describes (its cached config.json),
    its tensors found through ``table_file`` (``write_tensor_table``'s)."""
    arch, tensors = read_tensor_table(path, table_file)
    types = Counter(t.tensor_type.name for t in tensors.values())
    names = _name_map(arch, config.num_layers)
    fixups = _Fixups(arch, config)
    dequantized: dict[str, list[str]] = defaultdict(list)

    def find(hf_name: str) -> FileTensor:
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        tensor = tensors.get(f"{gguf_name}.{suffix}") if gguf_name else None
        if tensor is None:
            raise ValueError(f"{path.name}: no tensor for {hf_name} (expected {gguf_name}.{suffix})")
        return tensor

    def float_of(hf_name: str) -> torch.Tensor:
        tensor = find(hf_name)
        if tensor.tensor_type not in FLOAT_TYPES:
            dequantized[tensor.tensor_type.name].append(tensor.name)
        return fixups.float(hf_name, torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))

    def quant_of(hf_name: str) -> QuantWeight | None:
        tensor = find(hf_name)
        if tensor.tensor_type not in SERVED_TYPES:
            return None
        out_features, in_features = tensor.data.shape[0], int(tensor.shape[0])
        rows = fixups.rows(hf_name, _as_tensor(tensor.data))
        weight = QuantWeight(rows, tensor.tensor_type, in_features, out_features)
        if weight.packed:  # its copy is the one kept: the map's pages of it go now, not after the last tensor
            _release_pages_of(tensor)
        return weight

    projections: list[dict[str, Weight]] = []
    floats: list[tuple[str, torch.Tensor]] = []
    grouped = _projection_parts(config)
    for i in range(config.num_layers):
        layer: dict[str, Weight] = {}
        for attr, parts in grouped.items():
            hf_names = [f"model.layers.{i}.{suffix}" for suffix in parts]
            quant = [quant_of(name) for name in hf_names]
            if all(q is not None for q in quant):
                layer[attr] = quant[0] if len(quant) == 1 else stack_outputs(quant)
            else:  # a part without a kernel: the group is served in float, side by side as fused
                layer[attr] = torch.cat([float_of(name).T for name in hf_names], dim=1).contiguous()
        projections.append(layer)
        floats += [(f"model.layers.{i}.{suffix}", float_of(f"model.layers.{i}.{suffix}"))
                   for suffix in config.family.weights if suffix not in _flat(grouped)]
    floats.append(("model.norm.weight", float_of("model.norm.weight")))
    embed = quant_of("model.embed_tokens.weight")
    if embed is None:
        embed = float_of("model.embed_tokens.weight")
    head = None
    if not config.tie_word_embeddings:
        head = quant_of("lm_head.weight")
        if head is None:
            head = float_of("lm_head.weight")
    if any(isinstance(w, QuantWeight) and w.packed for w in _flat_weights(embed, head, projections)):
        _release_mapped_pages(tensors)
    if dequantized:
        listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(dequantized.items()))
        warnings.warn(f"{path.name}: no kernel for these tensor types, dequantized to float32 at load ({listed})",
                      stacklevel=2)
    return GgufWeights(embed, head, projections, floats, dict(dequantized), dict(types))


def _flat_weights(embed: Weight, head: Weight | None, projections: list[dict[str, Weight]]) -> Iterator[Weight]:
    yield embed
    if head is not None:
        yield head
    for layer in projections:
        for w in layer.values():
            yield from getattr(w, "parts", [w])


def _releasable_map(data: np.ndarray) -> mmap.mmap | None:
    """The map ``data`` is a view of, where this system can let its pages go; else None."""
    mapped = getattr(data, "_mmap", None)
    return mapped if mapped is not None and hasattr(mmap, "MADV_DONTNEED") else None


def _release_pages_of(tensor: FileTensor) -> None:
    """Drops the map's resident pages that lie wholly inside ``tensor`` (those it shares with a neighbour stay
    until ``_release_mapped_pages``)."""
    mapped = _releasable_map(tensor.data)
    if mapped is None:
        return
    start = -(-tensor.offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (tensor.offset + tensor.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _release_mapped_pages(tensors: dict[str, FileTensor]) -> None:
    """Drops the map's resident pages from this process (the file's page cache keeps them)."""
    mapped = next((_releasable_map(t.data) for t in tensors.values()), None)
    if mapped is not None:
        mapped.madvise(mmap.MADV_DONTNEED)


def _name_map(arch: str, num_layers: int) -> gguf.TensorNameMap:
    for key, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return gguf.get_tensor_name_map(key, num_layers)
    raise ValueError(f"GGUF architecture {arch!r} is not known to gguf-py")


def _projection_parts(config: ModelConfig) -> dict[str, list[str]]:
    """Our fused projections -> their parts' checkpoint suffixes, in output order."""
    parts: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for suffix, (attr, part) in config.family.weights.items():
        if attr in ("qkv", "o", "gate_up", "down"):
            order = GROUP_PARTS[attr].index(part) if part is not None else 0
            parts[attr].append((order, suffix))
    return {attr: [suffix for _, suffix in sorted(items)] for attr, items in parts.items()}


def _flat(grouped: dict[str, list[str]]) -> set[str]:
    return {suffix for suffixes in grouped.values() for suffix in suffixes}


def _as_tensor(data: np.ndarray) -> torch.Tensor:
    """A torch view of a tensor's bytes in the read-only map: nothing writes into weights, and the
    kernels' repacking copies what it changes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(data)


class _Fixups:
    """transformers' per-architecture changes to tensors, on quantized rows or on floats."""

    def __init__(self, arch: str, config: ModelConfig) -> None:
        self.permute_qk = arch in PERMUTED_QK_ARCHS
        self.norm_plus_one = arch in NORM_PLUS_ONE_ARCHS
        self.heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    def _row_order(self, hf_name: str, rows: int) -> torch.Tensor | None:
        if not self.permute_qk:
            return None
        proj = next((p for p in self.heads if f".{p}." in hf_name), None)
        if proj is None:
            return None
        heads = self.heads[proj]
        # The file's row h*2d + 2j + s is the checkpoint's row h*2d + s*d + j (d = rows per half-head).
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def rows(self, hf_name: str, data: torch.Tensor) -> torch.Tensor:
        order = self._row_order(hf_name, data.shape[0])
        return data if order is None else data[order]

    def float(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        weight = self.rows(hf_name, weight)
        if self.norm_plus_one and hf_name.endswith("norm.weight"):
            weight = weight - 1
        return weight.float()
