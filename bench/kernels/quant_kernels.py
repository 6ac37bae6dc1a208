"""The quantized projection kernels alone (engine/csrc/quant*.cpp) against the float32 panel kernel.

Each format runs on the int8 tiles (``int8``) and, where the CPU runs oneDNN's bfloat16 micro-kernel
(AMX), on the many-row panel path too (``amx``: csrc/quant_dequant_panel.cpp, forced at every row
count); ``old/this`` is the old path's time over each path's: the int8 tiles' for a format (for ``BF16 amx``,
the bfloat16 panel kernel's over its). The weights
dequantized to bfloat16 (``--dtype bfloat16``) run as panels too: on the panel kernel (``BF16 panels``)
and, where the CPU has AMX, on oneDNN's micro-kernel over the same panels (``BF16 amx``).

Every projection of ``--layers`` layers of a ~1B Llama shape (hidden 2048, FFN 8192: 2048->3072
qkv, 2048->2048 o, 2048->16384 gate/up, 8192->2048 down), multiplied by ``rows`` rows, in each
GGUF block format and as float32 panels. A format repacked at load (quant_linear.REPACKED_TYPES)
runs on the int8 kernels twice: packed (``<name> int8``) and in the file's layout (``<name> file``, TIERGATE_QUANT_REPACK=0),
so the ratio of the two is measured in the same run. Two layers of the smallest format (Q4_0, ~68 MB) are
beyond the caches, so a pass reads its weights from memory as a decode step does. Random valid
blocks: the kernels' speed does not depend on the values. Formats and panels alternate, rounds
in turn, in one process; printed: the median time of a pass (wall, and CPU per thread, which
a machine shared with other work inflates less), the weight bytes read per second (the decode
bound), multiply-adds per second (the prefill bound) and the panel kernel's time over each format's.
The bandwidth floor: the time to read each form's weight bytes at the read bandwidth measured
here (a sum over a buffer 4x the weights' largest form, same threads), and the fraction of it a
pass reaches.

With ``--row-prefetch-ab`` each 32-input format's int8 kernel also runs with its one-row prefetch forced
on (``<name> pf on``) and off (``<name> pf off``; ``TIERGATE_QUANT_ROW_PREFETCH``): past one row the
three forms run the same code, so the comparison is the one-row lines'.

    .venv/bin/python -m bench.kernels.quant_kernels [--rows 1,8,32,512] [--rounds 5] [--threads 2] [--layers 2]
        [--types Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K] [--isa auto|avx512|avx2|scalar] [--row-prefetch-ab]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import gguf
import torch

from bench.common import machine
from bench.common.report import write_json
from engine.packed_linear import PackedWeight, pack, panel_kernel_present
from engine.quant_linear import REPACKED_TYPES, QuantWeight, kernel_isa, quant_kernels_present, row_prefetch
from engine.quantize import random_blocks

LAYER_SHAPES = ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048))  # (in, out)
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _quant_weights(type_name: str, layers: int, repack: bool) -> list[PackedWeight]:
    ggml_type = gguf.GGMLQuantizationType[type_name]
    os.environ["TIERGATE_QUANT_REPACK"] = "1" if repack else "0"
    try:
        return [QuantWeight(torch.from_numpy(random_blocks(ggml_type, n, k, seed=i)), ggml_type, k, n)
                for i, (k, n) in enumerate(LAYER_SHAPES * layers)]
    finally:
        del os.environ["TIERGATE_QUANT_REPACK"]


def read_bandwidth(nbytes: int, rounds: int) -> float:
    """Bytes per second a sum over ``nbytes`` of float32 reads on torch's threads (the median of ``rounds``)."""
    buf = torch.ones(nbytes // 4)
    times = []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:])


def _panel_weights(layers: int, dtype: torch.dtype = torch.float32) -> list[PackedWeight]:
    gen = torch.Generator().manual_seed(0)
    return [pack((torch.randn(k, n, generator=gen) * 0.05).to(dtype), "panels") for k, n in LAYER_SHAPES * layers]


def _pass(weights: list[PackedWeight], inputs: dict[int, torch.Tensor], amx_rows: str,
          one_row_prefetch: str = "auto") -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) of one pass over ``weights``, the AMX paths' row
    thresholds (``TIERGATE_QUANT_PANEL_ROWS``, ``TIERGATE_BF16_AMX_ROWS``) set to ``amx_rows`` and
    ``TIERGATE_QUANT_ROW_PREFETCH`` to ``one_row_prefetch``."""
    os.environ["TIERGATE_QUANT_PANEL_ROWS"] = os.environ["TIERGATE_BF16_AMX_ROWS"] = amx_rows
    os.environ["TIERGATE_QUANT_ROW_PREFETCH"] = one_row_prefetch
    started, cpu = time.perf_counter(), time.process_time()
    for w in weights:
        w(inputs[w.in_features])
    return time.perf_counter() - started, time.process_time() - cpu


def run(rows_list: list[int], rounds: int, threads: int, layers: int, types: list[str],
        row_prefetch_ab: bool = False) -> dict:
    torch.set_num_threads(threads)
    if not quant_kernels_present() or not panel_kernel_present():
        raise SystemExit("the CPU kernels did not build here")
    forms: dict[str, list[PackedWeight]] = {}
    panel_rows: dict[str, str] = {}  # each form's AMX row threshold: off (the int8 kernels) or 1 (always AMX)
    prefetch: dict[str, str] = {}  # forms whose one-row prefetch is forced on or off
    amx = bool(torch.ops.tiergate.quant_panel_supported())
    for t in types:
        forms[f"{t} int8"], panel_rows[f"{t} int8"] = _quant_weights(t, layers, repack=True), "off"
        if row_prefetch_ab and gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == 32:
            for setting in ("on", "off"):
                name = f"{t} pf {setting}"
                forms[name], panel_rows[name], prefetch[name] = forms[f"{t} int8"], "off", setting
        if gguf.GGMLQuantizationType[t] in REPACKED_TYPES:
            forms[f"{t} file"], panel_rows[f"{t} file"] = _quant_weights(t, layers, repack=False), "off"
        if amx:
            forms[f"{t} amx"], panel_rows[f"{t} amx"] = forms[f"{t} int8"], "1"
    forms["F32 panels"], panel_rows["F32 panels"] = _panel_weights(layers), "off"
    forms["BF16 panels"], panel_rows["BF16 panels"] = _panel_weights(layers, torch.bfloat16), "off"
    if torch.ops.tiergate.panel_amx_supported():
        forms["BF16 amx"], panel_rows["BF16 amx"] = forms["BF16 panels"], "1"
    largest = max(sum(w.nbytes for w in ws) for ws in forms.values())
    bandwidth = read_bandwidth(4 * largest, rounds)
    macs = sum(k * n for k, n in LAYER_SHAPES * layers)
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k, _ in LAYER_SHAPES}
        inputs_bf16 = {k: x.bfloat16() for k, x in inputs.items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}
        for i in range(rounds + 1):  # the first round warms up
            for name in forms if i % 2 == 0 else reversed(list(forms)):
                elapsed = _pass(forms[name], inputs_bf16 if name.startswith("BF16") else inputs, panel_rows[name],
                                prefetch.get(name, "auto"))
                if i:
                    times[name].append(elapsed)
        medians = {name: statistics.median(wall for wall, _ in t) for name, t in times.items()}
        panel = medians["F32 panels"]
        for name, t in times.items():
            median = medians[name]
            # The old path of the same weights: the int8 kernels for a format, the panel kernel for bfloat16.
            int8 = medians.get(name.split()[0] + (" int8" if name[0] == "Q" else " panels"), median)
            nbytes = sum(w.nbytes for w in forms[name])
            # CPU time per thread: on a machine shared with other work the wall time counts their turns too.
            cpu = statistics.median(c for _, c in t) / threads
            results.append({"rows": rows, "form": name, "median_ms": median * 1e3, "cpu_ms_per_thread": cpu * 1e3,
                            "weight_mb": nbytes / 1e6, "weight_gb_s": nbytes / median / 1e9,
                            "floor_ms": nbytes / bandwidth * 1e3, "of_floor": nbytes / bandwidth / median,
                            "gmac_s": macs * rows / median / 1e9, "panel_time_over_this": panel / median,
                            "int8_time_over_this": int8 / median})
    return {"machine": machine.describe(), "threads": threads, "layers": layers, "isa": kernel_isa(),
            "row_prefetch": row_prefetch(), "rounds": rounds, "read_gb_s": bandwidth / 1e9, "results": results}


def _print(report: dict) -> None:
    print(f"isa {report['isa']} (one-row prefetch {'on' if report['row_prefetch'] else 'off'}), "
          f"{report['threads']} threads, {report['layers']} layers of the ~1B shape, "
          f"median of {report['rounds']} rounds; read bandwidth {report['read_gb_s']:.1f} GB/s; "
          f"load {report['machine']['load_average']}")
    print(f"{'rows':>5} {'form':>11} {'ms':>9} {'cpu ms':>9} {'MB':>7} {'GB/s':>7} {'GMAC/s':>8} {'panel/this':>10} "
          f"{'floor ms':>9} {'of floor':>8} {'file/this':>9} {'old/this':>9}")
    by_key = {(r["rows"], r["form"]): r for r in report["results"]}
    for r in report["results"]:
        file_form = by_key.get((r["rows"], f"{r['form'].split()[0]} file")) if r["form"].endswith("int8") else None
        vs_file = f"{file_form['median_ms'] / r['median_ms']:>8.2f}x" if file_form else f"{'':>9}"
        print(f"{r['rows']:>5} {r['form']:>11} {r['median_ms']:>9.2f} {r['cpu_ms_per_thread']:>9.2f} "
              f"{r['weight_mb']:>7.1f} {r['weight_gb_s']:>7.1f} {r['gmac_s']:>8.1f} {r['panel_time_over_this']:>9.2f}x "
              f"{r['floor_ms']:>9.2f} {r['of_floor']:>7.0%} {vs_file} {r['int8_time_over_this']:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--isa", default="auto")
    parser.add_argument("--row-prefetch-ab", action="store_true",
                        help="the 32-input formats' int8 kernels also with the one-row prefetch forced on and off")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    os.environ["TIERGATE_QUANT_ISA"] = args.isa
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        print(f"--types: unknown {unknown}; expected some of {','.join(TYPES)}", file=sys.stderr)
        return 2
    report = run([int(r) for r in args.rows.split(",")], args.rounds, args.threads, args.layers, types,
                 args.row_prefetch_ab)
    _print(report)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
