"""Reading peft LoRA adapters: validation against the base model, then the weights.

`inspect_adapter` checks a peft directory (adapter_config.json + the safetensors
header, no weight data) and returns an `AdapterSpec`, or raises `AdapterError`
naming the problem. Modules are named as the base model's family names them: a
module that is several of our projections fused (Phi-3's `qkv_proj`,
`gate_up_proj`) is served as those projections sharing its A, each with its rows of B. `load_adapter` then reads the weights into per-projection
stacks over all layers, ready to be copied into a device slot. Both build their
result locally, so a refused adapter leaves nothing behind.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Short projection names (as engine/lora_hook.py spells them) -> peft module name and parent.
PROJ_MODULES = {
    "q": ("q_proj", "self_attn"), "k": ("k_proj", "self_attn"), "v": ("v_proj", "self_attn"),
    "o": ("o_proj", "self_attn"), "gate": ("gate_proj", "mlp"), "up": ("up_proj", "mlp"),
    "down": ("down_proj", "mlp"),
}
# peft module name -> (parent, our projections it covers, in the order of its output rows).
_MODULES = {
    **{module: (parent, (proj,)) for proj, (module, parent) in PROJ_MODULES.items()},
    "qkv_proj": ("self_attn", ("q", "k", "v")), "gate_up_proj": ("mlp", ("gate", "up")),
}
# The text model's layers; image-text checkpoints (Gemma 3) put them under language_model, in either
# of transformers' layouts.
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\."
    r"(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$"
)
# Weights for the vision tower of an image-text checkpoint: images are not served, so they change nothing.
_VISION_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:vision_tower|multi_modal_projector)\.")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# peft options that change what the adapter computes beyond y += B(A(x)) * scale.
_VARIANT_OPTIONS = (
    "use_dora", "lora_bias", "alora_invocation_tokens", "use_qalora", "use_bdlora",
    "layer_replication", "trainable_token_indices", "target_parameters", "velora_config",
    "monteclora_config", "arrow_config", "kasa_config",
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the problem."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: layer count and (in_features, out_features) per projection."""

    num_layers: int
    projections: dict[str, tuple[int, int]]

    @classmethod
    def for_llama(cls, num_layers: int, hidden_size: int, intermediate_size: int,
                  num_attention_heads: int, num_key_value_heads: int,
                  head_dim: int | None = None) -> BaseShapes:
        head_dim = head_dim or hidden_size // num_attention_heads
        q_out, kv_out = num_attention_heads * head_dim, num_key_value_heads * head_dim
        return cls(num_layers, {
            "q": (hidden_size, q_out), "k": (hidden_size, kv_out), "v": (hidden_size, kv_out),
            "o": (q_out, hidden_size), "gate": (hidden_size, intermediate_size),
            "up": (hidden_size, intermediate_size), "down": (intermediate_size, hidden_size),
        })

    @classmethod
    def from_model_config(cls, config) -> BaseShapes:
        """From the engine's ModelConfig (read by attribute, so lora_pool needs no engine import)."""
        return cls.for_llama(config.num_layers, config.hidden_size, config.intermediate_size,
                             config.num_heads, config.num_kv_heads, config.head_dim)


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter directory; `modules` maps (layer, proj) -> (rank, scale)."""

    name: str
    path: Path
    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[int, float]]
    # (layer, proj) -> the peft module holding it and its rows of that module's B.
    sources: dict[tuple[int, str], tuple[str, int, int]] = field(default_factory=dict)

    @functools.cached_property  # asked for every projection of every step's batch
    def targets(self) -> frozenset[str]:
        return frozenset(proj for _, proj in self.modules)


@dataclass
class AdapterWeights:
    """Host copy of an adapter: per projection, A [layers, rank, in] and B [layers, out, rank].

    Layers the adapter does not touch are zero. Where a module's own scale differs from
    `spec.scale` (peft's alpha_pattern/rank_pattern) the ratio is folded into its B, so one
    scale per adapter suffices downstream.
    """

    spec: AdapterSpec
    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / needed).is_file():
            hint = " (only safetensors weights are served)" if needed == WEIGHTS_FILE else ""
            raise AdapterError(f"{path} has no {needed}{hint}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path / CONFIG_FILE} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict, max_rank: int) -> None:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not served")
    for option in _VARIANT_OPTIONS:
        if config.get(option):
            raise AdapterError(f"LoRA variant option {option}={config[option]!r} is not served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} is not served; only bias='none'")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {config['modules_to_save']} are not served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank r={rank!r} is not a positive integer")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError(f"rank {max(ranks)} exceeds max_lora_rank {max_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unserved = [t for t in targets if t.rsplit(".", 1)[-1] not in _MODULES]
        if unserved:
            raise AdapterError(f"target modules {unserved} are not served "
                               f"(only {', '.join(_MODULES)})")
    elif not isinstance(targets, str):  # a regex or "all-linear": the weight keys decide
        raise AdapterError(f"target_modules={targets!r} is neither a list nor a pattern")


def _pattern_value(patterns: dict, module_name: str, default):
    """peft's rule: a pattern key applies to a module whose name ends with it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _module_scale(config: dict, module_name: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def inspect_adapter(name: str, path: str | Path, shapes: BaseShapes, max_rank: int) -> AdapterSpec:
    """Validate a peft directory against the base model without reading weight data."""
    path = Path(path)
    config = _read_config(path)
    _check_config(config, max_rank)
    try:
        with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
            header = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{path / WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
    halves: dict[tuple[int, str], dict[str, list[int]]] = {}
    stems: dict[tuple[int, str], str] = {}  # each module's name in the file, without peft's prefix
    for key, (dtype, shape) in header.items():
        if _VISION_KEY.match(key):
            continue
        match = _KEY.match(key)
        module = _MODULES.get(match.group(3)) if match else None
        if module is None or match.group(2) != module[0]:
            raise AdapterError(f"weight {key!r} is for a module that is not served")
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"weight {key!r} has dtype {dtype}; only float weights are served")
        layer = int(match.group(1))
        if layer >= shapes.num_layers:
            raise AdapterError(f"weight {key!r} is for layer {layer} but the base model has "
                               f"{shapes.num_layers} layers")
        halves.setdefault((layer, match.group(3)), {})[match.group(4)] = list(shape)
        stems[(layer, match.group(3))] = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    if not halves:
        raise AdapterError(f"{path / WEIGHTS_FILE} holds no LoRA weights")
    modules, sources = {}, {}
    for (layer, module), pair in sorted(halves.items()):
        parent, projs = _MODULES[module]
        module_name = f"model.layers.{layer}.{parent}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{module_name} has lora_{'A' if 'A' in pair else 'B'} "
                               f"but no lora_{'B' if 'A' in pair else 'A'}")
        in_features = shapes.projections[projs[0]][0]
        outs = [shapes.projections[p][1] for p in projs]
        rank = pair["A"][0]
        if pair["A"] != [rank, in_features] or pair["B"] != [sum(outs), rank]:
            raise AdapterError(
                f"{module_name}: lora_A {pair['A']} / lora_B {pair['B']} do not fit the base model's "
                f"{'/'.join(projs)} projection ({in_features} -> {sum(outs)}); different base shape?")
        if rank > max_rank:
            raise AdapterError(f"{module_name} has rank {rank}, above max_lora_rank {max_rank}")
        row = 0
        for proj, out in zip(projs, outs):
            if (layer, proj) in modules:
                raise AdapterError(f"{module_name} covers {proj}, which another module of layer {layer} covers too")
            modules[(layer, proj)] = (rank, _module_scale(config, module_name, rank))
            sources[(layer, proj)] = (stems[(layer, module)], row, row + out)
            row += out
    rank = max(r for r, _ in modules.values())
    return AdapterSpec(name, path, rank, _module_scale(config, "", config["r"]), modules, sources)


def load_adapter(spec: AdapterSpec, shapes: BaseShapes, dtype: torch.dtype) -> AdapterWeights:
    """Read the weights of an inspected adapter into zero-padded per-projection stacks."""
    weights = AdapterWeights(spec)
    for proj in sorted(spec.targets):
        in_features, out_features = shapes.projections[proj]
        weights.a[proj] = torch.zeros(shapes.num_layers, spec.rank, in_features, dtype=dtype)
        weights.b[proj] = torch.zeros(shapes.num_layers, out_features, spec.rank, dtype=dtype)
    prefix = "base_model.model."
    try:
        with safe_open(spec.path / WEIGHTS_FILE, framework="pt") as f:
            keys = set(f.keys())
            for (layer, proj), (rank, scale) in spec.modules.items():
                stem, lo, hi = spec.sources[(layer, proj)]
                stem = prefix + stem if prefix + stem + ".lora_A.weight" in keys else stem
                weights.a[proj][layer, :rank] = f.get_tensor(stem + ".lora_A.weight")
                b = f.get_tensor(stem + ".lora_B.weight")[lo:hi].to(torch.float64) * (scale / spec.scale)
                weights.b[proj][layer, :, :rank] = b
    except (OSError, RuntimeError, SafetensorError) as exc:  # the file changed since it was inspected
        raise AdapterError(f"reading {spec.path / WEIGHTS_FILE} failed: {exc}") from exc
    return weights
