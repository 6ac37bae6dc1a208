"""A whole decode step's LoRA work on the CPU: torch's padded bmms against the C++ kernel (lora_rows_).

On the bundled SmolLM2-135M's shapes (30 layers; hook calls qkv, o, gate_up, down), ``--slots``
adapter slots filled with random weights of ranks 8 and 16 alternating on all seven projections
(``--ranks halves``: the first half of the slots rank 8, the rest 16, so an even count of slots per
thread gives one thread twice the other's bytes) (``max_lora_rank`` 16, so the rank-8 slots are zero-padded as the pool keeps them), ``--rows``
decode rows spread round-robin over the slots: every hook call of a step, as the engine makes
them, through ``lora_pool.ops.apply_group``, on three paths: ``torch`` (a gather, padded bmms over
float32 stacks, an index_add per call), ``kernel`` (torch.ops.tiergate.lora_rows_,
engine/csrc/lora_rows.cpp, on float32 stacks) and ``kernel bf16`` (the same on bfloat16 stacks, as
the engine keeps them over a quantized model), the kernel reading its stacks ahead into the cache level
``lora_pool.ops.prefetch_level`` picks on this CPU, and ``kernel bf16 L1`` and ``L2`` with each level
forced (which one pays differs between cores). The paths alternate round by round in one process,
so they see the same machine; printed: the median step time, the stacks' bytes (all of them, the
rank-8 slots' zero padding included), the adapters' own bytes (each slot's rank rows only: what a
step must read), the rate a step reads those at, and torch's time over each path's.

With ``--prefill`` each slot's rows are one run, as prefill chunks are (torch's path then gives each
its own matmul pair, as it does in the engine without the kernel).

    .venv/bin/python -m bench.kernels.lora_step [--slots 16] [--rows 32] [--prefill] [--ranks alternating|halves]
        [--rounds 15] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine
from bench.common.report import write_json
from engine.cpu_build import cpu_kernels_loaded
from lora_pool import ops

HIDDEN, INTERMEDIATE, LAYERS, KV = 576, 1536, 30, 192  # SmolLM2-135M
PROJECTIONS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
               "gate": (HIDDEN, INTERMEDIATE), "up": (HIDDEN, INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}
HOOKS = ("qkv", "o", "gate_up", "down")


def rank_of(slot: int, slots: int, layout: str = "alternating") -> int:
    if layout == "halves":
        return 8 if slot < slots // 2 else 16
    return 16 if slot % 2 else 8


def adapter_bytes(slots: int, dtype: torch.dtype, layout: str) -> int:
    """The bytes of the slots' adapters at their own ranks: what a step that uses them all must read."""
    per_rank = sum(fan_in + fan_out for fan_in, fan_out in PROJECTIONS.values()) * LAYERS * dtype.itemsize
    return sum(rank_of(slot, slots, layout) for slot in range(slots)) * per_rank


def stacks_of(slots: int, dtype: torch.dtype, layout: str) -> tuple[dict[str, list[ops.LayerStacks]], int]:
    """Every hook's per-layer views of random stacks (ranks 8 and 16 laid out as ``layout``), and their bytes."""
    a, b, fused_a = ops.cpu_stacks(PROJECTIONS, LAYERS, slots, 16, dtype)
    gen = torch.Generator().manual_seed(0)
    for proj, (fan_in, fan_out) in PROJECTIONS.items():
        for slot in range(slots):
            rank = rank_of(slot, slots, layout)
            a[proj][:, slot, :rank] = (torch.randn(LAYERS, rank, fan_in, generator=gen) / fan_in**0.5).to(dtype)
            b[proj][:, slot, :, :rank] = (torch.randn(LAYERS, fan_out, rank, generator=gen) * 0.01).to(dtype)
    nbytes = sum(t.untyped_storage().nbytes() for t in [*fused_a.values(), *b.values()])
    nbytes += sum(a[p].untyped_storage().nbytes() for p in ("o", "down"))
    return ops.layer_views(a, b, fused_a, list(HOOKS)), nbytes


def step(views: dict[str, list[ops.LayerStacks]], plan: ops.CpuPlan, xs: dict[str, torch.Tensor],
         ys: dict[str, torch.Tensor], slots: list[int]) -> None:
    for layer in range(LAYERS):
        for hook in HOOKS:
            ops.apply_group(xs[hook], ys[hook], views[hook][layer], plan, slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true",
                        help="each slot's rows in one run (prefill chunks: torch's path gives each its own matmuls)")
    parser.add_argument("--ranks", choices=["alternating", "halves"], default="alternating",
                        help="ranks 8 and 16 by slot: alternating, or the first half 8 and the rest 16")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels_loaded(), "the CPU kernels did not build (see the log)"
    if args.prefill:  # each slot's rows one run, as a prefill chunk's
        row_slots = [row * args.slots // args.rows for row in range(args.rows)]
    else:
        row_slots = [row % args.slots for row in range(args.rows)]
    info = {slot: (rank_of(slot, args.slots, args.ranks), 2.0) for slot in range(args.slots)}
    slots = list(range(args.slots))
    in_of = {"qkv": HIDDEN, "o": HIDDEN, "gate_up": HIDDEN, "down": INTERMEDIATE}
    out_of = {"qkv": HIDDEN + 2 * KV, "o": HIDDEN, "gate_up": 2 * INTERMEDIATE, "down": HIDDEN}
    xs = {hook: torch.randn(args.rows, in_of[hook]) for hook in HOOKS}
    ys = {hook: torch.zeros(args.rows, out_of[hook]) for hook in HOOKS}
    stacks = {dtype: stacks_of(args.slots, dtype, args.ranks) for dtype in (torch.float32, torch.bfloat16)}
    auto = ops.prefetch_level()
    paths = {"torch": (torch.float32, False), "kernel": (torch.float32, auto), "kernel bf16": (torch.bfloat16, auto),
             "kernel bf16 L1": (torch.bfloat16, 1), "kernel bf16 L2": (torch.bfloat16, 2)}
    plans = {False: ops.plan_rows(row_slots, info),
             **{level: ops.plan_rows(row_slots, info, kernel=True, prefetch_to=level) for level in (1, 2)}}
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):
            for name, (dtype, kernel) in paths.items():  # kernel: False (torch) or the read-ahead level
                start = time.perf_counter()
                step(stacks[dtype][0], plans[kernel], xs, ys, slots)
                if round_:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
    host = machine.describe()
    print(machine.render_markdown(host))
    kind = "prefill" if args.prefill else "decode"
    print(f"{args.rows} {kind} rows over {args.slots} slots (ranks 8 and 16 {args.ranks}, max 16), {LAYERS} layers x "
          f"{len(HOOKS)} hook calls, {args.threads} threads, median of {args.rounds} rounds; the kernel reads "
          f"ahead into L{auto} here (L1 data cache {ops.l1_data_cache_bytes() // 1024} KiB)")
    torch_ms = statistics.median(times["torch"]) * 1e3
    results = {}
    for name, (dtype, _) in paths.items():
        ms = statistics.median(times[name]) * 1e3
        nbytes, needed = stacks[dtype][1], adapter_bytes(args.slots, dtype, args.ranks)
        results[name] = {"ms": ms, "stack_mb": nbytes / 1e6, "adapter_mb": needed / 1e6,
                         "gb_per_s": needed / ms / 1e6, "torch_over": torch_ms / ms}
        print(f"{name:>14}: {ms:7.2f} ms a step, stacks {nbytes / 1e6:6.1f} MB, adapters {needed / 1e6:6.1f} MB "
              f"read at {needed / ms / 1e6:5.1f} GB/s, torch/this {torch_ms / ms:4.2f}x")
    if args.json:
        write_json({"machine": host, "args": vars(args), "prefetch_level": auto, "results": results}, args.json)


if __name__ == "__main__":
    main()
