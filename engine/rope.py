"""Rotary position embeddings as HF computes them: the frequencies of every served scaling, the
per-step cos/sin tables and their in-place application to q and k.

LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) has two sets of frequencies: a sequence longer than
``original_max_position_embeddings`` uses the long set, a shorter one the short set, and HF's Phi-3
recomputes the whole sequence when it first grows past that length (``prepare_inputs_for_generation``
drops the cache). So the set is a property of the sequence at the step, not of the position: the
runner passes one flag per row (``Sequence.is_long_context``), and the scheduler recomputes a
sequence's keys when it crosses (scheduler/scheduler.py). Both sets are scaled by one attention factor.

With ``partial_rotary_factor`` < 1 only the first ``rotary_dim`` dimensions of each head rotate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` as HF computes them for ``cfg``'s scaling;
    ``long`` picks LongRoPE's long set."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * cfg.rope_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, cfg, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_factor(cfg: ModelConfig, scaling: dict) -> float:
    # Without a factor (DeepSeek-V3's configs) HF takes the context ratio.
    return scaling.get("factor") or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]


def _yarn_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN (HF's ``_compute_yarn_parameters``): frequencies that turn fewer than ``beta_slow`` times
    over the original context are interpolated (divided by the factor), those that turn more than
    ``beta_fast`` times kept, with a linear ramp over the dimensions between."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = _yarn_factor(cfg, scaling)

    def dimension_turning(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(scaling.get("beta_fast") or 32), dimension_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def rope_attention_factor(cfg: ModelConfig) -> float:
    """LongRoPE's and YaRN's scale of cos and sin (HF's ``_compute_longrope_parameters``; YaRN's
    below), 1 for other scalings.

    Given as ``attention_factor``, else from ``factor``, itself defaulting to
    ``max_position_embeddings / original_max_position_embeddings``: ``sqrt(1 + ln f / ln original)``
    above 1, else 1. Both frequency sets use it, short sequences included.
    """
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        return _yarn_attention_factor(cfg, scaling)
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class Rope(nn.Module):
    """One model's rotary tables (buffers, so they follow the model's ``to``); one ``tables`` call
    per step serves every layer."""

    long_inv_freq: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        longrope = cfg.long_context_after is not None
        self.register_buffer("long_inv_freq", rope_inv_freq(cfg, long=True).to(device) if longrope else None,
                             persistent=False)
        self.attention_factor = rope_attention_factor(cfg)
        # None when every dimension rotates (the common case: nothing sliced per layer).
        self.rotary_dim = cfg.rotary_dim if cfg.rotary_dim < cfg.head_dim else None
        self._cached: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # ``tables`` of positions 0, 1, ...

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, rotary_dim]`` for this step; ``long_rows`` (bool ``[T]``,
        LongRoPE only) marks the rows of sequences in the long regime.

        On CPU, rows are looked up in tables of every position so far, computed once (as vLLM's cos/sin
        cache): a decode step's few rows took ten small ops a step, each slow after a forward has streamed
        the weights through the caches. A position past the tables doubles them (found by index_select's
        IndexError, which on a GPU would be a device-side assert instead: there they are computed)."""
        if long_rows is not None or positions.device.type != "cpu":
            return self._computed(positions, dtype, long_rows)
        cached = self._cached.get(dtype)
        if cached is not None:
            try:
                return cached[0].index_select(0, positions), cached[1].index_select(0, positions)
            except IndexError:
                pass
        known = 0 if cached is None else cached[0].shape[0]
        upto = max(2 * known, 1 << max(int(positions.max()), 255).bit_length()) if positions.numel() else known
        every = torch.arange(upto, device=positions.device)
        self._cached[dtype] = self._computed(every, dtype)
        return self.tables(positions, dtype)

    def _computed(
        self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tables`` computed for these positions."""
        inv_freq = self.inv_freq[None, :]
        if long_rows is not None:
            inv_freq = torch.where(long_rows[:, None], self.long_inv_freq[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): folding the sign saves a neg per layer.
        cos = torch.cat((cos, cos), dim=-1).to(dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> None:
    """Rotate ``x`` ``[T, heads, dim]`` by the tables in place (a view: rotated keys stay next to the
    values in the fused qkv output). With partial rotary ``x`` is the rotary slice of each head.
    ``fused``: one call of the CPU kernel (csrc/pointwise.cpp) instead of torch's five ops."""
    if fused and x.stride(-1) == 1:
        torch.ops.tiergate.rope_(x, cos, sin)
        return
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos).addcmul_(swapped, sin)


def _yarn_attention_factor(cfg: ModelConfig, scaling: dict) -> float:
    """YaRN's scale of cos and sin: given, or ``0.1 ln(factor) + 1`` (with DeepSeek's ``mscale`` and
    ``mscale_all_dim``, the ratio of two such terms)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(cfg, scaling)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()

