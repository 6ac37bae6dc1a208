"""A chat or completion body's sampling knobs: OpenAI's (temperature, top_p, seed, presence and
frequency penalties, logit_bias) and the extensions vLLM serves beside them (top_k, min_p,
repetition_penalty, min_tokens), checked and read into the engine's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.request import MAX_LOGIT_BIAS_TOKENS
from gateway.errors import invalid_param
from gateway.json_fields import float_field, int_field, is_int, is_number, optional

SAMPLING_FIELDS = frozenset({"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                             "top_k", "min_p", "repetition_penalty", "min_tokens"})


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (vLLM's -1 reads as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    min_tokens: int = 0  # checked against max_tokens by the engine, once that is known


def parse_sampling(body: dict) -> Sampling:
    top_k = int_field(body, "top_k", -1)
    repetition = float_field(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True)
    return Sampling(
        temperature=float_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=float_field(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k or 0, 0),
        min_p=float_field(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=float_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=float_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition,
        logit_bias=_logit_bias(body),
        seed=_seed(body),
        min_tokens=int_field(body, "min_tokens", 0) or 0,
    )


def _seed(body: dict) -> int | None:
    seed = optional(body, "seed")
    if seed is not None and not is_int(seed):
        raise invalid_param("seed", "Invalid type for 'seed': expected an integer.", "invalid_type")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise invalid_param("seed", "Invalid value for 'seed': it must fit in a signed 64-bit integer.",
                            "invalid_value")
    return seed


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases in [-100, 100]; whether each id is in the
    model's vocabulary the engine's own check says (engine/validation.py)."""
    value: Any = optional(body, "logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid_param("logit_bias", "Invalid type for 'logit_bias': expected an object mapping token ids to "
                            "biases.", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid_param("logit_bias", f"Invalid value for 'logit_bias': at most {MAX_LOGIT_BIAS_TOKENS} tokens "
                            "may be biased.", "invalid_value")
    biases = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid_param("logit_bias", f"Invalid key in 'logit_bias': {key!r} is not a token id.",
                                "invalid_value")
        if not is_number(bias) or not -100 <= bias <= 100:
            raise invalid_param("logit_bias", f"Invalid value in 'logit_bias' for token {key}: a bias must be a "
                                "number in [-100, 100].", "invalid_value")
        biases.append((int(key), float(bias)))
    return tuple(biases)
