"""Runs the Triton paged decode attention kernel under TRITON_INTERPRET=1 against the float64 reference.

Executed in a subprocess by test_paged_attention_triton.py, so the interpreter setting cannot
leak into other tests. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from paged_attention_reference import CASES, VARIANTS, random_case, reference, variant_case  # noqa: E402

from engine.triton_paged_attention import paged_decode_attention  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


def check(case: str, dtype: torch.dtype) -> None:
    if case in VARIANTS:
        data = variant_case(case, dtype)
    else:
        lens, heads, kv_heads, head_dim, block_size = CASES[case]
        data = random_case(lens, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=len(case))
    out = paged_decode_attention(data.q, data.kv_cache, data.block_tables, data.context_lens, data.scale,
                                 data.window, data.softcap)
    error = (out.double() - reference(data)).abs().max().item()
    ok = out.shape == (data.q.shape[0], data.q.shape[1] * data.q.shape[2]) and out.dtype == dtype
    ok = ok and error < TOLERANCE[dtype]
    print(f"{case} {dtype}: max abs error {error:.2e} {'ok' if ok else 'MISMATCH'}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    for case in [*CASES, *VARIANTS]:
        check(case, torch.float32)
    check("odd_block_size", torch.float16)
    print("all cases match")
