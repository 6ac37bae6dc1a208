"""The settings that send a projection with many rows to oneDNN's AMX micro-kernel.

Two paths read one: quantized weights (engine/quant_linear.py, ``TIERGATE_QUANT_PANEL_ROWS``) and
the bfloat16 panels (engine/packed_linear.py, ``TIERGATE_BF16_AMX_ROWS``). Each variable holds the
fewest rows of x a call needs to take the micro-kernel: a count, ``off`` (never), or ``auto`` (the
path's measured default where the CPU runs the micro-kernel, never elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable

from tiergate_common.env import EnvError


def parse_min_rows(variable: str, asked: str, default: int, supported: Callable[[], bool]) -> int | None:
    """The fewest rows ``asked`` (the variable's value) sends to the micro-kernel, None for none.
    Raises EnvError (a ValueError) for a value that is not a positive count, ``off`` or ``auto``, or a count
    where ``supported()`` says this CPU cannot run the micro-kernel."""
    asked = asked.strip().lower()
    if asked == "off":
        return None
    if asked in ("", "auto"):
        return default if supported() else None
    if not asked.isdigit() or int(asked) < 1:
        raise EnvError(f"{variable}={asked!r}: expected a count of rows >= 1, off or auto")
    if not supported():
        raise EnvError(f"{variable}: this CPU cannot run oneDNN's bfloat16 micro-kernel (no AMX)")
    return int(asked)
