"""Reading one field of a request's JSON body: its type and range checked, each failure an
OpenAI-shaped 400 naming the field. JSON null reads as an absent field (OpenAI's clients send nulls)."""

from __future__ import annotations

import math
from typing import Any

from gateway.errors import invalid_param


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return is_int(v)  # not math.isfinite: an int past float's range raises there


def optional(body: dict, name: str) -> Any:
    """A field's value, treating JSON null like an absent field (OpenAI's clients send nulls)."""
    return body.get(name)


def int_field(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = optional(body, name)
    if v is None:
        return None
    if not is_int(v):
        raise invalid_param(name, f"Invalid type for '{name}': expected an integer, but got {type(v).__name__}.",
                            "invalid_type")
    if v < lo or (hi is not None and v > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid_param(name, f"Invalid value for '{name}': {v}; it must be {bound}.", "invalid_value")
    return v


def float_field(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = optional(body, name)
    if v is None:
        return default
    if not is_number(v):
        raise invalid_param(name, f"Invalid type for '{name}': expected a number, but got {type(v).__name__}.",
                            "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid_param(name, f"Invalid value for '{name}': {v}; it must be in {interval}.", "invalid_value")
    return float(v)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = optional(body, name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid_param(name, f"Invalid type for '{name}': expected a boolean, but got {type(v).__name__}.",
                            "invalid_type")
    return v


def str_field(body: dict, name: str) -> str | None:
    v = optional(body, name)
    if v is not None and not isinstance(v, str):
        raise invalid_param(name, f"Invalid type for '{name}': expected a string, but got {type(v).__name__}.",
                            "invalid_type")
    return v
