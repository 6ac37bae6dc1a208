"""Runs the Triton LoRA kernels against the float64 reference: under TRITON_INTERPRET=1 on the CPU (a
subprocess of test_triton_kernels.py, so the setting cannot leak into other tests), or compiled for a GPU
where there is one (bench/cuda_check.py). Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

import torch  # noqa: E402
from lora_reference import CASES, random_case, reference  # noqa: E402

from lora_pool.triton_ops import KernelPlan, run_kernels  # noqa: E402

RANKS = [3, 16, 5]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
assert INTERPRETED or torch.cuda.is_available(), "run with TRITON_INTERPRET=1, or where there is a GPU"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def check(case: str, dtype: torch.dtype, fused: bool) -> None:
    chunks = CASES[case]
    x, y, a, b, scales = random_case(chunks, fan_in=72, fan_out=80, ranks=RANKS, max_rank=16, dtype=dtype)
    row_slots = [s for s, n in chunks for _ in range(n)]
    expected = reference(x, y, a, b, scales, row_slots, RANKS)
    x, y, a, b = (t.to(DEVICE) for t in (x, y, a, b))
    out = y
    if fused:  # y as a column slice of a wider output, as with a fused qkv projection
        wide = torch.zeros(y.shape[0], 200, dtype=dtype, device=DEVICE)
        wide[:, 50:130] = y
        out = wide[:, 50:130]
    plan = KernelPlan.build(chunks, scales, max_rank=16, device=DEVICE)
    run_kernels(x, out, a, b, plan)
    error = ((out.double().cpu() - expected).abs() / (expected.abs() + 1)).max().item()
    ok = error < TOLERANCE[dtype]
    if fused:
        ok = ok and wide[:, :50].abs().sum() == 0 and wide[:, 130:].abs().sum() == 0
    print(f"{case} {dtype} fused={fused}: max relative error {error:.2e} {'ok' if ok else 'MISMATCH'}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    for case in CASES:
        check(case, torch.float32, fused=False)
    check("mixed", torch.float32, fused=True)
    check("mixed", torch.float16, fused=False)
    if not INTERPRETED:  # the dtype CUDA serves in; the interpreter has no bfloat16 arithmetic
        for case in CASES:
            check(case, torch.bfloat16, fused=False)
    print("all kernels match")
