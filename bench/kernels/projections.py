"""A decode step's projections alone: the panel kernel against oneDNN's packed linear and torch.mm.

Every projection of the bundled SmolLM2-135M's shape (30 layers of 576->960 qkv,
576->576 o, 576->3072 gate/up, 1536->576 down, and the 576->49152 LM head: 538 MB in
float32, far more than the caches hold, so every pass reads the weights from
memory as a real step does) multiplied by ``rows`` rows, in each weight form of
engine/packed_linear.py. Random weights of the model's shapes: the kernels' speed does not
depend on the values. The forms run in alternating order in one process, so they
share the machine's state; the medians, the bandwidth and flop rates they reach, and
the panel kernel's ratio over each other form are printed.

    .venv/bin/python -m bench.kernels.projections [--rows 1,8,16,32,64,128] [--rounds 7] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.common import machine, report
from engine.packed_linear import FORMS, Weight, linear, pack, weight_form

LAYERS = 30
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out): qkv, o, gate_up, down
HEAD_SHAPE = (576, 49152)


def _weights(form: str) -> list[tuple[int, Weight]]:
    """(in features, packed weight) for every projection of a step, in forward order."""
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD_SHAPE]
    return [(k, pack(torch.randn(k, n, generator=gen) * 0.05, form)) for k, n in shapes]


def _step(weights: list[tuple[int, Weight]], inputs: dict[int, torch.Tensor]) -> None:
    for k, weight in weights:
        linear(inputs[k], weight)


def run(rows_list: list[int], rounds: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    forms = [f for f in FORMS if _available(f)]
    weights = {form: _weights(form) for form in forms}
    total_bytes = sum(k * n * 4 for k, n in [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD_SHAPE])
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k in {s[0] for s in LAYER_SHAPES}}
        times: dict[str, list[float]] = {form: [] for form in forms}
        for i in range(rounds + 1):  # the first round warms up
            for form in forms if i % 2 == 0 else reversed(forms):
                started = time.perf_counter()
                _step(weights[form], inputs)
                if i:
                    times[form].append(time.perf_counter() - started)
        medians = {form: statistics.median(t) for form, t in times.items()}
        flops = 2 * rows * total_bytes / 4
        results.append({
            "rows": rows,
            "ms": {form: s * 1e3 for form, s in medians.items()},
            "gb_per_s": {form: total_bytes / s / 1e9 for form, s in medians.items()},
            "gflop_per_s": {form: flops / s / 1e9 for form, s in medians.items()},
            "panels_speedup": {form: medians[form] / medians["panels"] for form in forms if form != "panels"},
        })
        print(f"rows {rows}: " + ", ".join(f"{f} {medians[f] * 1e3:.2f} ms" for f in forms), file=sys.stderr, flush=True)
    return {"machine": machine.describe(), "threads": threads, "rounds": rounds, "weight_mb": total_bytes / 1e6,
            "forms": forms, "results": results}


def _available(form: str) -> bool:
    if form == "plain":
        return True
    try:
        pack(torch.zeros(16, 16), form)
        return True
    except Exception:  # a form this build cannot serve is left out of the table
        return False


def render_markdown(result: dict) -> str:
    forms = result["forms"]
    others = [f for f in forms if f != "panels"]
    lines = [
        machine.render_markdown(result["machine"]),
        "",
        f"Every projection of one decode step of the bundled model's shape ({result['weight_mb']:.0f} MB of float32 "
        f"weights, read from memory each pass), {result['threads']} threads, median of {result['rounds']} passes per "
        "form, forms alternating in one process.",
        "",
        "| rows | " + " | ".join(f"{f} ms (GB/s, GFLOP/s)" for f in forms) + " | "
        + " | ".join(f"panels over {f}" for f in others) + " |",
        "|---:|" + "---|" * len(forms) + "---:|" * len(others),
    ]
    for r in result["results"]:
        cells = [f"{r['ms'][f]:.2f} ({r['gb_per_s'][f]:.1f}, {r['gflop_per_s'][f]:.0f})" for f in forms]
        ratios = [f"{r['panels_speedup'][f]:.2f}x" for f in others]
        lines.append(f"| {r['rows']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels.projections", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if weight_form("cpu", torch.float32) != "panels":
        print("projections: the panel kernel is not available on this machine", file=sys.stderr)
        return 1
    result = run([int(r) for r in args.rows.split(",")], args.rounds, args.threads)
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
