"""Reading one field of a request's JSON body: its type and range checked, each failure an
OpenAI-shaped 400 naming the field. JSON null reads as an absent field (OpenAI's clients send nulls)."""

from __future__ import annotations

import math
from collections.abc import Callable
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


def typed(body: dict, name: str, check: Callable[[Any], bool], expected: str) -> Any:
    """The field's value (None when absent or null), refused with 400 unless ``check`` holds for it."""
    v = optional(body, name)
    if v is not None and not check(v):
        raise invalid_param(name, f"Invalid type for '{name}': expected {expected}, but got {type(v).__name__}.",
                            "invalid_type")
    return v


def int_field(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = typed(body, name, is_int, "an integer")
    if v is None:
        return None
    if v < lo or (hi is not None and v > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid_param(name, f"Invalid value for '{name}': {v}; it must be {bound}.", "invalid_value")
    return v


def float_field(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = typed(body, name, is_number, "a number")
    if v is None:
        return default
    if v > hi or v < lo or (lo_open and v == lo):
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid_param(name, f"Invalid value for '{name}': {v}; it must be in {interval}.", "invalid_value")
    return float(v)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = typed(body, name, lambda v: isinstance(v, bool), "a boolean")
    return default if v is None else v


def str_field(body: dict, name: str) -> str | None:
    return typed(body, name, lambda v: isinstance(v, str), "a string")
