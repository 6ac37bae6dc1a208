"""The shape of a served model, read from a Hugging Face ``config.json``.

Only what the native forward needs; anything the forward cannot honour
(a family engine/families.py does not describe, unexpected biases, an unknown
RoPE scaling or activation) is refused here with a clear error instead of
producing wrong logits later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.families import ACTIVATIONS, FAMILIES, Family, family_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # HF's rope scaling dict (``rope_type`` plus its parameters); None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    activation: str = "silu"
    # How many previous positions (itself included) a token of a windowed layer attends to,
    # and which layers are windowed; no window when it covers max_position_embeddings.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # The attention's softmax scale; None means head_dim ** -0.5.
    attn_scale: float | None = None
    # The share of each head's dimensions that rotate (the first ones); the rest pass through.
    partial_rotary_factor: float = 1.0
    # Gemma 3: the layers (its sliding ones) whose plain RoPE has a base of its own.
    local_rope_theta: float | None = None
    local_rope_layers: tuple[int, ...] = ()
    # SmolLM3: layers without any position embedding (NoPE).
    nope_layers: tuple[int, ...] = ()
    # Granite: embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before it joins the residual stream, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def family(self) -> Family:
        return family_for(self.model_type)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_context_after(self) -> int | None:
        """With LongRoPE, the length past which a sequence runs on the long factors; else None."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        cfg = _text_model(cfg)
        model_type = cfg.get("model_type", "")
        family = family_for(model_type, cfg.get("architectures"))
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{family.name} configs with use_bidirectional_attention (embedding models) "
                             "are not served")
        # Qwen2's q/k/v biases come with the family; Seed-OSS names them with attention_bias.
        bias = cfg.get("attention_bias", family.qkv_bias if family.bias_flag else False)
        if (bias and not family.qkv_bias) or cfg.get("mlp_bias") or cfg.get("attention_out_bias"):
            raise ValueError(f"{family.name} configs with attention_bias, attention_out_bias or mlp_bias are not "
                             "supported")
        if family.bias_flag and not bias:
            raise ValueError(f"{family.name} configs without attention_bias are not supported")
        activation = cfg.get(family.activation_key) or "silu"
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported {family.activation_key} {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if (family.local_rope or family.global_nope) and not cfg.get("layer_types"):
            cfg = {**cfg, "layer_types": _layer_types(cfg, family)}
        # transformers 5 keeps theta and scaling in ``rope_parameters``; older configs at top level.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        local_theta, local_layers = None, ()
        if family.local_rope:
            rope, local_theta = _split_local_rope(cfg, rope, family)
            local_layers = tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention")
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = family.rope_aliases.get(rope_type, rope_type)
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        _check_rope(cfg, family, rope_type, rope, head_dim, partial)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            activation=activation,
            **_windows(cfg, family),
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            attn_scale=_attn_scale(cfg),
            partial_rotary_factor=partial,
            local_rope_theta=local_theta,
            local_rope_layers=local_layers,
            nope_layers=_nope_layers(cfg, family),
            embedding_multiplier=float(cfg.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        return cls.from_dict(json.loads(path.read_text()))


def _check_rope(cfg: dict[str, Any], family: Family, rope_type: str, rope: dict[str, Any], head_dim: int,
                partial: float) -> None:
    """Refuse a rotary embedding the family's HF model would compute otherwise than we do; complete
    LongRoPE's and YaRN's parameters in ``rope`` with the original context length."""
    if partial != 1.0:
        if not family.partial_rotary:
            served = ", ".join(f.name for f in FAMILIES.values() if f.partial_rotary)
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor < 1) are not supported for "
                             f"{family.name}; served for: {served}")
        if not 0 < partial < 1 or int(head_dim * partial) % 2:
            raise ValueError(f"partial_rotary_factor {partial} must be in (0, 1] and rotate an even number of "
                             f"dimensions of the head ({head_dim})")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "yarn":  # as HF: the top-level original length wins, else the scaling's, else the context
        rope["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings")
                                                       or rope.get("original_max_position_embeddings")
                                                       or cfg.get("max_position_embeddings", 2048))
        return
    if rope_type != "longrope":
        return
    if not family.longrope:
        served = ", ".join(f.name for f in FAMILIES.values() if f.longrope)
        raise ValueError(f"longrope scaling is not supported for {family.name}; served for: {served}")
    # Phi-3 keeps the original length at the top level, which wins over a copy in the scaling dict (as in HF).
    original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    rope["original_max_position_embeddings"] = int(original)
    pairs = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ValueError(f"longrope scaling needs a {key} list of {pairs} numbers (rotary dimensions / 2)")


def _attn_scale(cfg: dict[str, Any]) -> float | None:
    """The softmax scale where a config sets it: Gemma's query_pre_attn_scalar, Granite's attention_multiplier."""
    if cfg.get("attention_multiplier"):
        return float(cfg["attention_multiplier"])
    if cfg.get("query_pre_attn_scalar"):
        return float(cfg["query_pre_attn_scalar"]) ** -0.5
    return None


def _nope_layers(cfg: dict[str, Any], family: Family) -> tuple[int, ...]:
    """The layers without RoPE: EXAONE 4's global layers when it has windows; SmolLM3's from
    ``no_rope_layers`` (1: rotate, 0: not), or every ``no_rope_layer_interval``-th layer."""
    if family.global_nope:
        if not cfg.get("sliding_window"):
            return ()
        return tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    if not family.nope_layers:
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(cfg["num_hidden_layers"])]
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _text_model(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model inside Gemma 3's image-text checkpoints (4B and up); the text
    model is served and the vision tower's weights are left unread. Other configs as they are."""
    if cfg.get("model_type") != "gemma3" or not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = {**cfg["text_config"], "model_type": "gemma3_text", "architectures": cfg.get("architectures")}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def _layer_types(cfg: dict[str, Any], family: Family) -> list[str]:
    """Older configs name a pattern instead: every ``sliding_window_pattern``-th layer is global, or
    a string of L (local) and G (global) that repeats (EXAONE 4's "LLLG")."""
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or family.global_every
    layers = range(cfg["num_hidden_layers"])
    if isinstance(pattern, str):
        return ["full_attention" if pattern[i % len(pattern)] == "G" else "sliding_attention" for i in layers]
    return ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in layers]


def _split_local_rope(cfg: dict[str, Any], rope: dict[str, Any], family: Family) -> tuple[dict[str, Any], float]:
    """The global layers' rope parameters, and the sliding layers' base (Gemma 3, OLMo 3).

    transformers 5 writes one parameter dict per layer type; older configs keep the global ones at
    the top level and the local base as ``rope_local_base_freq`` (or the family's default)."""
    default = cfg.get("rope_local_base_freq") or family.local_theta
    if "full_attention" not in rope and "sliding_attention" not in rope:
        return rope, float(default or rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"rope scaling {local.get('rope_type')!r} on sliding layers is not supported")
    global_rope = dict(rope.get("full_attention") or {})
    local_theta = local.get("rope_theta") or default or global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return global_rope, float(local_theta)


def _windows(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` as HF's model applies them."""
    window = cfg.get("sliding_window")
    if family.window_flag and not cfg.get("use_sliding_window"):
        window = None
    layers = cfg["num_hidden_layers"]
    if not window or window >= int(cfg.get("max_position_embeddings", 2048)):
        return {"sliding_window": None, "sliding_layers": ()}
    types = cfg.get("layer_types")
    if family.window_layers == "all":
        sliding = range(layers)
    elif types:
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    elif family.window_layers == "alternate":
        sliding = range(0, layers, 2)
    elif family.window_flag:  # Qwen's older configs: the layers from max_window_layers on
        sliding = range(int(cfg.get("max_window_layers", layers)), layers)
    else:  # Ministral's: a window means every layer
        sliding = range(layers)
    sliding = tuple(sliding)
    return {"sliding_window": int(window) if sliding else None, "sliding_layers": sliding}
