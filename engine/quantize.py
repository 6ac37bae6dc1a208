"""Float rows into GGUF block bytes, with the rounding of llama.cpp's reference quantizers.

Q8_0 and Q4_0 come from gguf-py (``gguf.quants.quantize``, bit-exact with ggml's reference).
gguf-py has no Q4_K quantizer, so ``_quantize_q4_k`` follows ggml's ``quantize_row_q4_K_ref``
(what ``llama-quantize`` runs without an importance matrix): per 32-value sub-block a
weighted least-squares search over 21 candidate scales for a scale and a min, then the eight
scales and mins of a 256-value super-block rounded to 6 bits against two float16 factors, and
the values requantized against the rounded scales. It is written here, vectorized over every
sub-block at once in float32 numpy, because no maintained Python package implements it; its
sums and products run in the C code's order, so its bytes are ggml's (checked against
libggml's quantize_row_q4_K_ref, which compiles without fused multiply-adds there).
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QK_K = 256
SUB = 32  # values per Q4_K sub-block
F32 = np.float32


def quantize_rows(rows: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Float32 ``[n, in]`` into uint8 ``[n, bytes_per_row]`` of ``ggml_type`` (Q8_0, Q4_0 or Q4_K)."""
    rows = np.ascontiguousarray(rows, dtype=F32)
    if ggml_type in (T.Q8_0, T.Q4_0):
        return gguf.quants.quantize(rows, ggml_type)
    if ggml_type == T.Q4_K:
        if rows.shape[-1] % QK_K:
            raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values, got {rows.shape[-1]}")
        blocks = _quantize_q4_k(rows.reshape(-1, QK_K))
        return blocks.reshape(rows.shape[0], -1)
    raise NotImplementedError(f"no quantizer for {ggml_type.name}")


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even."""
    return np.rint(v).astype(np.int32)


def _sum(terms: np.ndarray) -> np.ndarray:
    """Sums over the first axis in ggml's order, one term after another in float32 (numpy's own
    sum pairs terms up, and its roundings then moved some levels one step from llama.cpp's)."""
    total = terms[0].copy()
    for term in terms[1:]:
        total += term
    return total


def _fit_scale_min(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """ggml's make_qkx2_quants (squared error) over every column of ``x`` ``[32, n]`` at once (one
    sub-block a column, so each step of a sum is one contiguous pass): (scale, the_min, levels)
    with ``x ≈ scale * levels - the_min``; products associate as ggml's C does."""
    w = np.sqrt(_sum(x * x) / F32(x.shape[0])) + np.abs(x)
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    flat = hi == lo
    sum_w = _sum(w)
    sum_x = _sum(w * x)

    def error(scale: np.ndarray, levels: np.ndarray, low: np.ndarray) -> np.ndarray:
        diff = scale * levels + low - x
        return _sum(w * diff * diff)

    span = np.where(flat, F32(1), hi - lo)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    levels = np.clip(_nearest(iscale * (x - lo)), 0, nmax).astype(F32)
    best = error(scale, levels, lo)
    mins = lo.copy()
    for step in range(nstep + 1):
        # ggml searches from the best min so far, not the first one.
        cur_span = hi - mins
        cur_span = np.where(cur_span == 0, F32(1), cur_span)
        cand_iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / cur_span
        cand = np.clip(_nearest(cand_iscale * (x - mins)), 0, nmax).astype(F32)
        wl = w * cand
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * cand), _sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, F32(1)), this_scale)
        err = error(this_scale, cand, this_min)
        better = ok & (err < best) & ~(positive & (sum_l2 == 0))  # ggml's 0/0 there compares false
        levels = np.where(better, cand, levels)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mins = np.where(better, this_min, mins)
    scale = np.where(flat, F32(0), scale)
    levels = np.where(flat, F32(0), levels)
    return scale.astype(F32), (-mins).astype(F32), levels.astype(np.int32).T


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks ``[n, 256]`` into Q4_K bytes ``[n, 144]``."""
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(-1, SUB).T)
    scales, mins, levels = _fit_scale_min(sub, 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    levels = levels.reshape(n, 8, SUB)

    max_scale = np.maximum(scales.max(axis=1, keepdims=True), F32(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.minimum(_nearest(inv_scale * scales), 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min * mins), 63).astype(np.uint8)
    d16 = (max_scale / F32(63)).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(np.float16)

    # The values again against the scales as stored; a sub-block whose scale rounded to zero keeps its levels.
    d = d16.astype(F32) * ls.astype(F32)
    dm = dmin16.astype(F32) * lm.astype(F32)
    safe_d = np.where(d == 0, F32(1), d)
    requant = np.clip(_nearest((x.reshape(n, 8, SUB) + dm[..., None]) / safe_d[..., None]), 0, 15)
    levels = np.where((d == 0)[..., None], levels, requant).astype(np.uint8)

    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    # Sub-blocks 2i and 2i+1 share 32 bytes: the first in the low nibbles, the second in the high.
    qs = (levels[:, 0::2] | (levels[:, 1::2] << 4)).reshape(n, 128)
    return np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), packed, qs], axis=1)


def random_blocks(ggml_type: gguf.GGMLQuantizationType, rows: int, in_features: int, seed: int = 0,
                  scale: float = 0.01) -> np.ndarray:
    """Valid uint8 ``[rows, bytes_per_row]`` of ``ggml_type`` with every quant bit random and float16
    scales and mins drawn around ``scale`` (for tests and benches: any bit pattern is a valid block
    but a non-finite float16)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // block_size, type_size), dtype=np.uint8)
    # Where each format keeps its float16 fields: d (and dmin / m) first, Q6_K's d last.
    offsets = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[ggml_type]
    for offset in offsets:
        halves = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
