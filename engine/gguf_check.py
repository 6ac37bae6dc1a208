"""GGUF metadata that transformers' GGUF support leaves unread: read into the config, or the file refused.

transformers maps a fixed set of each architecture's GGUF keys into the HF config and leaves the
rest at the config class's defaults, so the model it builds from such a file is not always the one
the file holds: a Qwen3 head size other than 128, Phi-3's sliding window, partial rotary (Phi-4-mini),
Gemma 2's soft-caps, and the rope scaling llama.cpp keeps as tensors (Llama 3's ``rope_freqs``,
Phi-3's LongRoPE factors). ``complete_config`` sets each of these from the file; ``unread_metadata``
then checks the config against every key and tensor, and a file it still disagrees with is refused,
naming its family and the keys, instead of being served with other logits than its checkpoint's.

Llama 3's scaling is stored by llama.cpp as one factor per rotary frequency, computed from four
parameters; HF's config wants the parameters. The factors fix them up to one degree of freedom
(HF's formula uses the original context length only divided by the low and high frequency
factors), so ``low_freq_factor`` is taken as 1 and the rest solved for, then checked factor by
factor against the file.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.families import FAMILIES, Family
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    import gguf

# Tensors holding rope scaling (Llama 3's rope_freqs, Phi-3's LongRoPE factors): transformers reads none.
ROPE_FACTOR_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
# GGUF architectures whose HF model_type is another name.
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
FACTOR_RTOL = 1e-4  # float32 factors written from float64 parameters


@dataclass(frozen=True)
class GgufMetadata:
    architecture: str
    values: dict[str, Any]  # the architecture's scalar keys, without the "<architecture>." prefix
    tensor_names: frozenset[str]
    rope_factors: dict[str, np.ndarray] = field(default_factory=dict)  # by tensor name, float64

    @classmethod
    def read(cls, path: Path) -> GgufMetadata:
        import gguf

        return cls.of_reader(gguf.GGUFReader(str(path)))

    @classmethod
    def of_reader(cls, reader: gguf.GGUFReader) -> GgufMetadata:
        """From a file gguf-py's ``GGUFReader`` has parsed (seconds for a real token list: parse once)."""
        arch = reader.fields["general.architecture"].contents()
        prefix = f"{arch}."
        values = {key.removeprefix(prefix): field.contents() for key, field in reader.fields.items()
                  if key.startswith(prefix) and len(field.data) == 1}
        factors = {t.name: np.asarray(t.data, dtype=np.float64).reshape(-1) for t in reader.tensors
                   if t.name in ROPE_FACTOR_TENSORS}
        return cls(arch, values, frozenset(t.name for t in reader.tensors), factors)

    @property
    def family(self) -> Family | None:
        """The served family of the file's architecture; None for one we do not serve."""
        return FAMILIES.get(GGUF_MODEL_TYPES.get(self.architecture, self.architecture))

    @property
    def family_name(self) -> str:
        return self.family.name if self.family else self.architecture


def complete_config(meta: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``config`` for the file, with what the file says and the mapping left unread set."""
    out = copy.deepcopy(config)
    values = meta.values
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    key_length = values.get("attention.key_length")
    if key_length and key_length == values.get("attention.value_length", key_length) and key_length != head_dim:
        out["head_dim"] = head_dim = int(key_length)
    params = dict(out.get("rope_parameters") or {})
    # Gemma 3 has parameters per layer type; the file's rope keys are its global layers'.
    per_kind = "full_attention" in params
    rope = dict(params["full_attention"]) if per_kind else params
    if values.get("rope.scaling.type") == "linear" and float(values.get("rope.scaling.factor") or 1.0) != 1.0:
        rope.update(rope_type="linear", factor=float(values["rope.scaling.factor"]))
    rotary = values.get("rope.dimension_count")
    if rotary and rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key in values:
            out[key] = float(values[key])
    window = values.get("attention.sliding_window")
    family = meta.family
    if window and window < out.get("max_position_embeddings", math.inf) and not (family and family.window_flag):
        out["sliding_window"] = int(window)
    if "rope_factors_long.weight" in meta.rope_factors and "rope_factors_short.weight" in meta.rope_factors:
        rope.update(rope_type="longrope", long_factor=meta.rope_factors["rope_factors_long.weight"].tolist(),
                    short_factor=meta.rope_factors["rope_factors_short.weight"].tolist())
        original = values.get("rope.scaling.original_context_length")
        if original:
            out["original_max_position_embeddings"] = int(original)
            rope["original_max_position_embeddings"] = int(original)
        if values.get("rope.scaling.attn_factor"):
            rope["attention_factor"] = float(values["rope.scaling.attn_factor"])
    if "rope_freqs.weight" in meta.rope_factors:
        theta = float(rope.get("rope_theta", out.get("rope_theta", 10000.0)))
        rotary_dim = int(rotary or head_dim)
        rope.update(llama3_parameters(meta.rope_factors["rope_freqs.weight"], theta, rotary_dim) or {})
    if rope:
        out["rope_parameters"] = {**params, "full_attention": rope} if per_kind else rope
    return out


def llama3_parameters(factors: np.ndarray, theta: float, rotary_dim: int) -> dict[str, Any] | None:
    """HF's ``llama3`` rope parameters that give these per-frequency factors, or None if none do
    (the check in ``unread_metadata`` then refuses the file)."""
    if len(factors) != rotary_dim // 2:
        return None
    factor = float(factors.max())
    if math.isclose(factor, 1.0, rel_tol=FACTOR_RTOL):
        return None  # no scaling at all: plain RoPE, as the config already says
    per_wavelength = theta ** -(np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim) / (2 * math.pi)
    unscaled, scaled = factors <= 1 + FACTOR_RTOL, factors >= factor * (1 - FACTOR_RTOL)
    medium = ~unscaled & ~scaled
    if medium.sum() >= 2:
        # Between the boundaries 1/f = (1 - s)/factor + s, with s linear in 1/wavelength.
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(per_wavelength[medium], smooth, 1)
        if intercept >= 0 or slope <= 0:
            return None
        high_freq_factor = 1 - 1 / intercept
        original = slope * (high_freq_factor - 1)
    elif not medium.any() and unscaled.any():
        # No frequency between the boundaries: any two between the last unscaled wavelength and the
        # first scaled one give the same factors.
        last_unscaled, first_scaled = 1 / per_wavelength[unscaled].min(), 1 / per_wavelength[scaled].max()
        original = last_unscaled ** (1 / 3) * first_scaled ** (2 / 3)
        high_freq_factor = original / (last_unscaled ** (2 / 3) * first_scaled ** (1 / 3))
    else:
        return None
    # The boundaries are original / low and original / high: a whole original length (as HF's
    # config wants) with both factors scaled to it keeps them.
    whole = max(1, round(original))
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": whole / original,
            "high_freq_factor": float(high_freq_factor * whole / original), "original_max_position_embeddings": whole}


def unread_metadata(meta: GgufMetadata, config: dict[str, Any]) -> list[str]:
    """What ``meta`` says that the HF ``config`` does not; empty if nothing."""
    served = ModelConfig.from_dict(config)
    expected = {
        "attention.key_length": served.head_dim,
        "attention.value_length": served.head_dim,
        "rope.dimension_count": served.rotary_dim,
        "attn_logit_softcapping": served.attn_logit_softcap,
        "final_logit_softcapping": served.final_logit_softcap,
    }
    problems = [f"{meta.architecture}.{key} is {meta.values[key]} in the file but {want} in transformers' config"
                for key, want in expected.items() if key in meta.values and not _same(meta.values[key], want)]
    scaling_type = meta.values.get("rope.scaling.type")
    if scaling_type not in (None, "none") and float(meta.values.get("rope.scaling.factor") or 1.0) != 1.0:
        served_scaling = served.rope_scaling or {}
        if (served_scaling.get("rope_type"), served_scaling.get("factor")) != (
                scaling_type, float(meta.values["rope.scaling.factor"])):
            problems.append(f"{meta.architecture}.rope.scaling.type is {scaling_type} (factor "
                            f"{meta.values['rope.scaling.factor']}) in the file but {served_scaling or 'none'} "
                            f"in transformers' config")
    window = meta.values.get("attention.sliding_window")
    # A window as long as the context is none; Qwen's windows depend on a flag GGUF does not carry.
    if window and window < served.max_position_embeddings and not served.family.window_flag:
        if served.sliding_window != window:
            problems.append(f"{meta.architecture}.attention.sliding_window is {window} in the file but "
                            f"{served.sliding_window} in transformers' config")
    for name in sorted(meta.tensor_names & ROPE_FACTOR_TENSORS):
        served_factors = _served_factors(served, name)
        file_factors = meta.rope_factors.get(name)
        if served_factors is None or file_factors is None or file_factors.shape != served_factors.shape or not (
                np.allclose(file_factors, served_factors, rtol=FACTOR_RTOL, atol=0)):
            problems.append(f"its rope scaling factors ({name}) are not those of the config")
    return problems


def _served_factors(served: ModelConfig, name: str) -> np.ndarray | None:
    """The per-frequency factors llama.cpp would store under ``name`` for the config ``served``."""
    from engine.rope import rope_inv_freq  # torch, only for files that hold such tensors

    if name == "rope_freqs.weight":
        dim = served.rotary_dim
        plain = served.rope_theta ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
        return plain / rope_inv_freq(served).double().numpy()
    scaling = served.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    which = "long_factor" if name == "rope_factors_long.weight" else "short_factor"
    return np.asarray(scaling[which], dtype=np.float64)


def refusal(meta: GgufMetadata, problems: list[str]) -> ValueError:
    return ValueError(f"{meta.family_name} GGUF file not served: transformers' GGUF support does not map it "
                      f"({'; '.join(problems)}); serve the Hugging Face checkpoint directory instead")


def _same(value: Any, want: Any) -> bool:
    if want is None:
        return False
    return math.isclose(float(value), float(want), rel_tol=1e-6)
