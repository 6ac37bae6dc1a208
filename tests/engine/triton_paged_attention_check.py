"""Runs the Triton paged decode attention kernel against the float64 reference: under TRITON_INTERPRET=1 on
the CPU (a subprocess of test_paged_attention_triton.py, so the setting cannot leak into other tests), or
compiled for a GPU where there is one (bench/cuda_check.py). Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

import torch  # noqa: E402
from paged_attention_reference import CASES, VARIANTS, DecodeCase, random_case, reference, variant_case  # noqa: E402

from engine.triton_paged_attention import paged_decode_attention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
assert INTERPRETED or torch.cuda.is_available(), "run with TRITON_INTERPRET=1, or where there is a GPU"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def on_device(case: DecodeCase) -> DecodeCase:
    """The case on DEVICE, q still a strided column slice of a wider row as the engine passes it."""
    batch, heads, head_dim = case.q.shape
    wide = torch.zeros(batch, case.q.stride(0), dtype=case.q.dtype, device=DEVICE)
    wide[:, : heads * head_dim] = case.q.reshape(batch, -1).to(DEVICE)
    q = wide[:, : heads * head_dim].view(batch, heads, head_dim)
    return DecodeCase(q, case.kv_cache.to(DEVICE), case.block_tables.to(DEVICE), case.context_lens.to(DEVICE),
                      case.window, case.softcap)


def check(case: str, dtype: torch.dtype) -> None:
    if case in VARIANTS:
        data = variant_case(case, dtype)
    else:
        lens, heads, kv_heads, head_dim, block_size = CASES[case]
        data = random_case(lens, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=len(case))
    run = on_device(data)
    out = paged_decode_attention(run.q, run.kv_cache, run.block_tables, run.context_lens, run.scale,
                                 run.window, run.softcap)
    error = (out.double().cpu() - reference(data)).abs().max().item()
    ok = out.shape == (data.q.shape[0], data.q.shape[1] * data.q.shape[2]) and out.dtype == dtype
    ok = ok and error < TOLERANCE[dtype]
    print(f"{case} {dtype}: max abs error {error:.2e} {'ok' if ok else 'MISMATCH'}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    for case in [*CASES, *VARIANTS]:
        check(case, torch.float32)
    check("odd_block_size", torch.float16)
    if not INTERPRETED:  # the dtype CUDA serves in; the interpreter has no bfloat16 arithmetic
        for case in CASES:
            check(case, torch.bfloat16)
    print("all cases match")
