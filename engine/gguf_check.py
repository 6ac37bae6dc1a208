"""GGUF metadata that transformers' GGUF support leaves unread, checked against the config it builds.

transformers maps a fixed set of each architecture's GGUF keys into the HF config and leaves the
rest at the config class's defaults. Where the file says otherwise (Gemma 2's soft-caps, Phi-3's
sliding window, LongRoPE or Llama 3 rope factors, partial rotary, a Qwen3 head size other than the
default 128) the model transformers builds is not the one the file holds, so such a file is refused,
naming its family and the keys, instead of being served with other logits than its checkpoint's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.families import FAMILIES
from engine.model_config import ModelConfig

# Tensors holding rope scaling (Llama 3's rope_freqs, Phi-3's LongRoPE factors): transformers reads none.
ROPE_FACTOR_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


@dataclass(frozen=True)
class GgufMetadata:
    architecture: str
    values: dict[str, Any]  # the architecture's scalar keys, without the "<architecture>." prefix
    tensor_names: frozenset[str]

    @classmethod
    def read(cls, path: Path) -> GgufMetadata:
        import gguf

        reader = gguf.GGUFReader(str(path))
        arch = reader.fields["general.architecture"].contents()
        prefix = f"{arch}."
        values = {key.removeprefix(prefix): field.contents() for key, field in reader.fields.items()
                  if key.startswith(prefix) and len(field.data) == 1}
        return cls(arch, values, frozenset(t.name for t in reader.tensors))

    @property
    def family_name(self) -> str:
        family = FAMILIES.get(self.architecture)
        return family.name if family else self.architecture


def unread_metadata(meta: GgufMetadata, config: dict[str, Any]) -> list[str]:
    """What ``meta`` says that the HF ``config`` transformers built from it does not; empty if nothing."""
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
    window = meta.values.get("attention.sliding_window")
    # A window as long as the context is none; Qwen's windows depend on a flag GGUF does not carry.
    if window and window < served.max_position_embeddings and not served.family.window_flag:
        if served.sliding_window != window:
            problems.append(f"{meta.architecture}.attention.sliding_window is {window} in the file but "
                            f"{served.sliding_window} in transformers' config")
    factors = sorted(meta.tensor_names & ROPE_FACTOR_TENSORS)
    if factors:
        problems.append(f"its rope scaling factors ({', '.join(factors)}) are not read")
    return problems


def refusal(meta: GgufMetadata, problems: list[str]) -> ValueError:
    return ValueError(f"{meta.family_name} GGUF file not served: transformers' GGUF support does not map it "
                      f"({'; '.join(problems)}); serve the Hugging Face checkpoint directory instead")


def _same(value: Any, want: Any) -> bool:
    if want is None:
        return False
    return math.isclose(float(value), float(want), rel_tol=1e-6)
