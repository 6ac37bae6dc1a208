"""The TIERGATE_* environment: one parser for its words, and the variables no ``Settings`` field carries.

Owns how an environment variable's text becomes a value (booleans, numbers, switches), so every
package reads its variables the same way and a bad value is one clear error naming the variable.
The gateway's ``Settings`` (gateway/settings.py) read their fields through ``parse``; the variables
declared below are read where they act (engine kernels, billing's defaults, the CLI), each when
asked, so a variable set after import (a test's monkeypatch) applies. Every package may import this
one; it imports nothing of ours (pyproject's import contracts). mini-sglang's env.py is the model:
a typed declaration per variable in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

PREFIX = "TIERGATE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

T = TypeVar("T")


class EnvError(ValueError):
    """An environment variable with a value we cannot use; the message names the variable."""


def parse_bool(name: str, raw: str) -> bool:
    """``raw`` as a boolean: one of TRUE_WORDS or FALSE_WORDS, in any case (``bool("0")`` is True)."""
    word = raw.strip().lower()
    if word in TRUE_WORDS + FALSE_WORDS:
        return word in TRUE_WORDS
    raise EnvError(f"{name} must be true or false, not {raw!r}")


def parse(name: str, raw: str, kind: type) -> Any:
    """``raw`` as a ``kind`` (bool, int, float or str); ``name`` is the variable the error names."""
    if kind is bool:
        return parse_bool(name, raw)
    try:
        return kind(raw.strip()) if kind in (int, float) else kind(raw)
    except ValueError:
        raise EnvError(f"{name} must be a {kind.__name__}, not {raw!r}") from None


@dataclass(frozen=True)
class Var(Generic[T]):
    """One TIERGATE_ variable: its name without the prefix, its type and its value when unset or empty."""

    name: str
    kind: type
    default: T

    @property
    def env_name(self) -> str:
        return PREFIX + self.name

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if environ is None else environ).get(self.env_name, "")
        return self.default if raw.strip() == "" else parse(self.env_name, raw, self.kind)


@dataclass(frozen=True)
class Switch:
    """A kernel switch: ``auto`` (or a true word) lets the code pick, a false word turns it ``off``,
    and ``extra`` names further choices."""

    name: str
    extra: tuple[str, ...] = ()

    @property
    def env_name(self) -> str:
        return PREFIX + self.name

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        word = (os.environ if environ is None else environ).get(self.env_name, "").strip().lower()
        if word in ("", "auto", *TRUE_WORDS):
            return "auto"
        if word in FALSE_WORDS:
            return "off"
        if word in self.extra:
            return word
        choices = ", ".join(("auto", "off", *self.extra))
        raise EnvError(f"{self.env_name} must be one of {choices} (or true/false), not {word!r}")


# Billing: the CLI's report prices GPU-hours at these per-tier rates ("standard=2,premium=6").
PRICES: Var[str | None] = Var("PRICES", str, None)
# Engine: where a GGUF file's config, tokenizer and dequantized checkpoint are cached (None: ~/.cache/tiergate).
CACHE_DIR: Var[str | None] = Var("CACHE_DIR", str, None)
# Engine: the engine thread's torch thread count (None: timed per step size, engine/cpu_threads.py).
CPU_THREADS: Var[int | None] = Var("CPU_THREADS", int, None)
# Engine: projections' form (engine/packed_linear.py): auto (panels, the same), onednn, or off/plain (torch.mm).
PACKED_WEIGHTS = Switch("PACKED_WEIGHTS", extra=("panels", "onednn", "plain"))
# Engine: the quantized kernels' path (engine/quant_linear.py): auto (the best this CPU runs), avx512,
# avxvnni, avx2 or scalar; quant_linear checks the name and the CPU.
QUANT_ISA: Var[str] = Var("QUANT_ISA", str, "auto")
# Engine: off keeps Q4_0/Q8_0/Q4_K/Q6_K weights in the file's layout instead of repacking them (engine/quant_linear.py).
QUANT_REPACK = Switch("QUANT_REPACK")
# Engine: the fewest rows of x that send a quantized projection (engine/quant_linear.py) or a bfloat16 one
# (engine/packed_linear.py) to oneDNN's AMX micro-kernel: a count, off, or auto (engine/amx_rows.py parses them).
QUANT_PANEL_ROWS: Var[str] = Var("QUANT_PANEL_ROWS", str, "auto")
BF16_AMX_ROWS: Var[str] = Var("BF16_AMX_ROWS", str, "auto")
# Engine: the cache level the batched LoRA kernel asks for the adapters' stacks ahead of its reads
# (lora_pool/ops.py): auto (by the core's L1 data cache), l1 or l2.
LORA_PREFETCH: Var[str] = Var("LORA_PREFETCH", str, "auto")
# Engine: whether one row of x asks for the 32-input formats' tiles ahead (engine/quant_linear.py):
# auto (on Intel cores), on or off.
QUANT_ROW_PREFETCH: Var[str] = Var("QUANT_ROW_PREFETCH", str, "auto")
# Engine: off attends over a gathered copy of each context instead of the in-place kernels.
PAGED_ATTENTION = Switch("PAGED_ATTENTION")
# Engine: off normalizes with torch's rms_norm instead of the fused kernel.
FUSED_NORMS = Switch("FUSED_NORMS")
# CLI: an unexpected error shows its traceback instead of one line.
DEBUG: Var[bool] = Var("DEBUG", bool, False)
