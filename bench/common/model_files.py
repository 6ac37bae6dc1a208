"""Where the benches find the bundled model in each peer's format.

The bundled SmolLM2-135M-Instruct ships as a Q4_1 GGUF. To compare like with
like, every peer runs the same dequantized float32 weights: transformers reads
the engine loader's safetensors cache of the GGUF, and llama.cpp reads an F32
GGUF written here from the very same dequantized tensors.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine.config import default_cache_dir


def cache_dir() -> Path:
    """The same root the engine's loader caches under (TIERGATE_CACHE_DIR)."""
    return Path(default_cache_dir()) / "bench"


def bundled_gguf() -> Path:
    from engine.loader import bundled_gguf_path  # torch and transformers, only when needed

    return bundled_gguf_path()


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """Write ``src`` with every tensor dequantized to float32, metadata unchanged.

    The tensors keep the GGUF layout (llama.cpp's permuted q/k rows), so the
    weights are exactly those transformers dequantizes from ``src``.
    """
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer sets these itself
        if key == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(tensor.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    tmp.rename(dst)
    return dst


def f32_gguf() -> Path:
    """The bundled model as an F32 GGUF, written once into the cache."""
    dst = cache_dir() / "SmolLM2-135M-Instruct.F32.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_f32_gguf(bundled_gguf(), dst)
    return dst


def hf_dir() -> Path:
    """The bundled model as a Hugging Face float32 directory.

    This is the engine loader's own cache of the dequantized GGUF (written on
    the engine's first start, or here if the engine never ran), so tiergate
    and transformers read the very same safetensors file.
    """
    from engine.gguf_cache import materialize_gguf

    return materialize_gguf(bundled_gguf(), Path(default_cache_dir()))
