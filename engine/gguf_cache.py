"""What a GGUF file needs derived once, kept under the cache: its config and tokenizer, and for
the dequantized path its float32 weights.

transformers' GGUF support reads the file's metadata into an HF config and tokenizer (seconds of
parsing); the result (config.json, tokenizer files) is kept under ``cache_dir`` keyed by the file's
path, size and mtime, with a table of where the file's tensors lie, so a later start reads that
directory and maps the file's tensors without parsing its metadata again (``metadata_dir``; the
weights come from the file itself, engine/gguf_weights.py). Serving a file
dequantized (``--dtype float32`` or ``bfloat16``, CUDA) keeps the path that dequantizes it through
transformers, tens of seconds even for the 135M bundled model, with the weights cached as
model.safetensors beside (``materialize_gguf``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.gguf_check import GgufMetadata, complete_config, refusal, unread_metadata
from engine.gguf_weights import write_tensor_table
from engine.model_config import ModelConfig

COMPLETE_MARKER = "tiergate-complete"
TENSOR_TABLE = "gguf-tensors.json"  # where the file's tensors lie (engine/gguf_weights.py), for native loading
# Set to "1": derive in the calling process instead of a spawned child. For the test suite, which derives
# dozens of tiny files and would pay a child's start (importing torch and transformers, seconds) for each.
DERIVE_IN_PROCESS = "TIERGATE_GGUF_DERIVE_IN_PROCESS"


def cache_dir_for(gguf_path: Path, cache_dir: Path, kind: str = "gguf") -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / kind / f"{gguf_path.stem}-{key}"


def materialize_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """The HF directory holding ``gguf_path``'s dequantized weights, converting it on first use."""
    return _derive(gguf_path, cache_dir_for(gguf_path, cache_dir), with_weights=True)


def metadata_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """The directory holding ``gguf_path``'s config.json and tokenizer files (no weights), derived on first use."""
    return _derive(gguf_path, cache_dir_for(gguf_path, cache_dir, "gguf-metadata"), with_weights=False)


def _derive(gguf_path: Path, target: Path, with_weights: bool) -> Path:
    if (target / COMPLETE_MARKER).exists():
        return target
    # Convert next to the target and rename, so an interrupted conversion never looks complete.
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        if os.environ.get(DERIVE_IN_PROCESS) == "1":
            convert_gguf(gguf_path, partial, with_weights)
        else:
            # In a child process, because the conversion's peak (transformers' model and its copies)
            # stays in the heap of the process that ran it: a first `tiergate serve` held 1.52 GB
            # against 1.30 GB for every later start. Spawned, not forked, as the caller may run threads.
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
                child.submit(convert_gguf, gguf_path, partial, with_weights).result()
        if not (target / COMPLETE_MARKER).exists():  # another process may have finished first
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, with_weights: bool = True) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    # Each transformers call re-parses the GGUF metadata (seconds each), so there are only three.
    what = "as safetensors" if with_weights else "(config and tokenizer)"
    with tqdm(total=3, desc=f"Caching {name} {what}", unit="stage") as progress:
        reader = gguf.GGUFReader(str(gguf_path))  # parsed once: the metadata and the tensor table read it
        meta = GgufMetadata.of_reader(reader)
        mapped = AutoConfig.from_pretrained(folder, gguf_file=name)
        config = complete_config(meta, mapped.to_dict())
        ModelConfig.from_dict(config)  # a clear error for families we do not serve
        problems = unread_metadata(meta, config)
        if problems:
            raise refusal(meta, problems)
        completed = type(mapped).from_dict(config)
        if with_weights:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=completed, dtype=torch.float32)
            completed, model_class = model.config, type(model)
        else:
            model, model_class = None, AutoModelForCausalLM._model_mapping[type(completed)]
        config = completed.to_dict()
        config.pop("quantization_config", None)
        if not config.get("architectures"):
            config["architectures"] = [model_class.__name__]
        progress.update()

        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(out_dir)
        progress.update()

        if model is None:
            write_tensor_table(reader, out_dir / TENSOR_TABLE)
        else:
            tied = bool(config.get("tie_word_embeddings"))
            state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
            save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
            config["dtype"] = "float32"
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        (out_dir / COMPLETE_MARKER).write_text(str(gguf_path.resolve()))
        progress.update()
