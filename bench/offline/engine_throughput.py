"""Engine throughput: tiergate against HF transformers and llama.cpp on the bundled model, this CPU.

A fixed seeded workload (64 requests, prompts 20-400 tokens of real text,
outputs 16-256 tokens, greedy, EOS ignored so every length is exact) runs at
each concurrency level through every engine: tiergate (fcfs, continuous
batching, the weights in float32 as every peer here reads them; the file's
own Q4_1 blocks against llama.cpp's are bench/offline/quantized.py's), HF transformers `generate` (float32; static left-padded batches
above concurrency 1), llama.cpp on an F32 GGUF of the very same weights and,
for reference only, on the Q4_1 original. Each engine runs in its own
subprocess so its peak RSS is its own. Prints a table and tiergate's ratio to
each peer; writes JSON and the step-time cost model fitted to tiergate's
steps (bench/out/step_cost.json, read by bench/sim/slo.py). With
``--single-stream-rounds R``, tiergate and llama.cpp-F32 run concurrency 1 in
R - 1 more rounds, alternating which goes first, and the single-stream goal
reads the median ratio (both are bound by a memory bandwidth that drifts on a
shared VM; see ``_single_stream_rounds``).

    .venv/bin/python -m bench.offline.engine_throughput [--requests 64] [--concurrency 1,8,32]
        [--single-stream-requests N] [--single-stream-rounds R] [--engines tiergate,llama.cpp-F32,...]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, model_files, paths, report
from bench.common.workload import BenchRequest, build_workload, load_encoder
from bench.offline.engine_throughput_report import render_markdown

# tiergate-plain is tiergate with its projections on torch.mm (TIERGATE_PACKED_WEIGHTS=0) and its
# decode attention over a gathered copy of the context (TIERGATE_PAGED_ATTENTION=off), as before
# the packed weights and the paged kernel: the engine issue's "today's tiergate", in the same run.
# tiergate-onednn packs its projections for oneDNN instead of tiergate's panel kernel (the
# fallback when the kernel cannot be built), to show what the kernel adds.
ENGINES = ("tiergate", "llama.cpp-F32", "llama.cpp-Q4_1", "hf-transformers", "tiergate-plain", "tiergate-onednn")
PEERS = ENGINES[1:]
STEP_COST_PATH = paths.OUT / "step_cost.json"


def _context_per_sequence(requests: list[BenchRequest]) -> int:
    longest = max(r.prompt_len + r.output_len for r in requests)
    return -(-longest // 256) * 256


def _make_runner(engine: str, requests: list[BenchRequest], max_concurrency: int, threads: int):
    if engine.startswith("tiergate"):
        from bench.peers.tiergate_runner import TiergateRunner

        # Each engine runs in its own worker process, so this setting stays with this one.
        plain = engine == "tiergate-plain"
        os.environ["TIERGATE_PACKED_WEIGHTS"] = {"tiergate-plain": "0", "tiergate-onednn": "onednn"}.get(engine, "auto")
        os.environ["TIERGATE_PAGED_ATTENTION"] = "off" if plain else "auto"
        os.environ["TIERGATE_FUSED_NORMS"] = "0" if plain else "1"

        # As `tiergate serve` runs: its tuner picks 1..N threads for each step size by timing steps
        # (engine/cpu_threads.py).
        if threads < (os.cpu_count() or 1):
            os.environ["TIERGATE_CPU_THREADS"] = str(threads)
        else:
            os.environ.pop("TIERGATE_CPU_THREADS", None)
        # float32, the file's values exactly, as llama.cpp-F32 and HF read them: `tiergate serve` would
        # keep the Q4_1 file in its own blocks, which is bench.offline.quantized's comparison.
        runner = TiergateRunner(max_concurrency, _context_per_sequence(requests), dtype="float32")
        runner.name = engine
        return runner
    if engine == "hf-transformers":
        from bench.peers.hf_transformers import HFTransformersRunner

        return HFTransformersRunner(model_files.hf_dir(), threads)
    if engine.startswith("llama.cpp-"):
        from bench.peers.llama_cpp_runner import LlamaCppRunner

        label = engine.removeprefix("llama.cpp-")
        path = model_files.f32_gguf() if label == "F32" else model_files.bundled_gguf()
        return LlamaCppRunner(path, label, threads)
    raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def _subset(requests: list[BenchRequest], concurrency: int, single_stream_requests: int | None):
    if concurrency == 1 and single_stream_requests:
        return requests[:single_stream_requests]
    return requests


def run_worker(engine: str, requests: list[BenchRequest], concurrencies: list[int],
               single_stream_requests: int | None, threads: int) -> dict:
    """One engine, every concurrency level, in this process."""
    import psutil

    started = time.perf_counter()
    runner = _make_runner(engine, requests, max(concurrencies), threads)
    runner.warm_up()
    load_s = time.perf_counter() - started
    runs = []
    for c in concurrencies:
        result = runner.run(_subset(requests, c, single_stream_requests), c)
        runs.append(result.to_json())
        print(f"  {engine} c={c}: {result.output_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    out = {
        "engine": engine,
        "threads": threads,
        "load_and_warm_up_s": load_s,
        # ru_maxrss is in KiB on Linux: the process's peak over load and every run.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_at_end_mb": psutil.Process().memory_info().rss / 2**20,
        "runs": runs,
    }
    if engine == "tiergate":
        from bench.sim.step_cost import fit_step_cost

        out["step_cost"] = fit_step_cost(runner.steps)
        out["step_cost"]["num_layers"] = runner.engine.model_config.num_layers
        out["step_cost"]["source"] = "tiergate engine steps of this run (bundled model in float32, this CPU)"
    if engine.startswith("tiergate"):
        runner.close()
    return out


def _spawn_worker(engine: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, "-m", "bench.offline.engine_throughput", "--worker", engine, "--out", tmp.name,
               "--requests", str(args.requests), "--concurrency", args.concurrency, "--seed", str(args.seed),
               "--prompt-len", args.prompt_len, "--output-len", args.output_len,
               "--threads", str(args.threads)]
        if args.single_stream_requests:
            cmd += ["--single-stream-requests", str(args.single_stream_requests)]
        proc = subprocess.run(cmd, stdout=sys.stderr, cwd=paths.ROOT)
        if proc.returncode != 0:
            return {"engine": engine, "error": f"worker exited with {proc.returncode}"}
        return json.loads(Path(tmp.name).read_text())


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _workload(args: argparse.Namespace) -> list[BenchRequest]:
    return build_workload(load_encoder(model_files.hf_dir()), args.requests, _range(args.prompt_len),
                          _range(args.output_len), seed=args.seed)


def copy_bandwidth_gbs(megabytes: int = 256, repeat: int = 5) -> float:
    """Main-memory bandwidth as a large array copy sees it (bytes read plus written), best of ``repeat``."""
    import numpy as np

    src = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best / 1e9


def read_bandwidth_gbs(threads: int, megabytes: int = 512, repeat: int = 5) -> float:
    """Main-memory read bandwidth as a sum over a large float32 array on ``threads`` threads sees it, best of ``repeat``."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


def decode_weight_bytes(config_path: Path) -> int:
    """Float32 weight bytes one decode step reads: every layer's projections and norms, the final
    norm and the LM head (the embedding lookup reads one row)."""
    cfg = json.loads(config_path.read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return 4 * (cfg["num_hidden_layers"] * per_layer + hidden + vocab * hidden)


def ratios(summaries: dict[str, dict[int, dict]]) -> dict[str, dict[int, float]]:
    """tiergate's output tokens/s over each peer's, per concurrency."""
    ours = summaries.get("tiergate", {})
    out: dict[str, dict[int, float]] = {}
    for peer in PEERS:
        for c, s in summaries.get(peer, {}).items():
            if c in ours and s["output_tokens_per_s"]:
                out.setdefault(peer, {})[c] = ours[c]["output_tokens_per_s"] / s["output_tokens_per_s"]
    return out


def run(args: argparse.Namespace) -> dict:
    """Every engine in its own subprocess; returns the combined results.

    With --json the file is rewritten after each engine, so a run cut short
    still leaves the engines it finished.
    """
    engines = [e for e in args.engines.split(",") if e]
    workload = _workload(args)
    model_files.f32_gguf()  # written once, before any worker times anything
    result = {
        "machine": machine.describe(),
        "workload": {
            "requests": len(workload),
            "seed": args.seed,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "prompt_tokens": sum(r.prompt_len for r in workload),
            "output_tokens": sum(r.output_len for r in workload),
            "single_stream_requests": args.single_stream_requests or len(workload),
        },
        "concurrency": [int(c) for c in args.concurrency.split(",")],
        "threads": args.threads,
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
        "read_bandwidth_gbs": read_bandwidth_gbs(args.threads),
        "f32_weight_bytes": model_files.f32_gguf().stat().st_size,
        "decode_weight_bytes": decode_weight_bytes(model_files.hf_dir() / "config.json"),
        "engines": [],
        "ratios": {},
        "complete": False,
    }
    for engine in engines:
        print(f"engine_throughput: {engine}", file=sys.stderr, flush=True)
        worker = _spawn_worker(engine, args)
        result["engines"].append(worker)
        if "step_cost" in worker:
            result["step_cost"] = worker["step_cost"]
        summaries = {w["engine"]: {r["summary"]["concurrency"]: r["summary"] for r in w.get("runs", [])}
                     for w in result["engines"]}
        result["ratios"] = {peer: {str(c): r for c, r in by_c.items()} for peer, by_c in ratios(summaries).items()}
        result["complete"] = engine == engines[-1]
        if args.json:
            report.write_json(result, args.json)
    if args.single_stream_rounds > 1 and {"tiergate", "llama.cpp-F32"} <= set(engines) and 1 in result["concurrency"]:
        result["single_stream_rounds"] = _single_stream_rounds(args, result)
        if args.json:
            report.write_json(result, args.json)
    return result


def _single_stream_rounds(args: argparse.Namespace, result: dict) -> dict:
    """tiergate against llama.cpp at concurrency 1 in more rounds, alternating which goes first.

    Both are bound by memory bandwidth at one request, and on a shared VM that bandwidth moves by
    tens of percent within a minute, so one pass each, a few minutes apart, compares the machine
    at two moments as much as the engines. The goal's figure is the median of the rounds' ratios.
    """
    first = result["ratios"].get("llama.cpp-F32", {}).get("1")
    ratios = [first] if first is not None else []
    one_level = argparse.Namespace(**{**vars(args), "concurrency": "1"})
    for round_no in range(1, args.single_stream_rounds):
        order = ["llama.cpp-F32", "tiergate"] if round_no % 2 else ["tiergate", "llama.cpp-F32"]
        speeds = {}
        for engine in order:
            print(f"engine_throughput: {engine}, single-stream round {round_no + 1}", file=sys.stderr, flush=True)
            runs = _spawn_worker(engine, one_level).get("runs") or [{}]
            speeds[engine] = runs[0].get("summary", {}).get("output_tokens_per_s")
        if speeds["tiergate"] and speeds["llama.cpp-F32"]:
            ratios.append(speeds["tiergate"] / speeds["llama.cpp-F32"])
    return {"ratios": ratios, "median": statistics.median(ratios) if ratios else None}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offline.engine_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--single-stream-requests", type=int, default=None,
                   help="run only the first N requests at concurrency 1 (it is the slowest level)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--prompt-len", default="20:400", help="prompt tokens, LO:HI uniform")
    p.add_argument("--output-len", default="16:256", help="output tokens, LO:HI uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every engine")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--single-stream-rounds", type=int, default=1,
                   help="measure tiergate and llama.cpp-F32 at concurrency 1 in this many alternating rounds")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--concurrency wants comma-separated integers")
    if not concurrencies or min(concurrencies) < 1 or args.requests < 1:
        p.error("--concurrency and --requests must be positive")
    try:
        for text in (args.prompt_len, args.output_len):
            lo, hi = _range(text)
            if not 0 < lo <= hi:
                raise ValueError
    except ValueError:
        p.error("--prompt-len and --output-len want LO:HI with 0 < LO <= HI")
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        result = run_worker(args.worker, _workload(args), [int(c) for c in args.concurrency.split(",")],
                            args.single_stream_requests, args.threads)
        report.write_json(result, args.out, indent=None)
        return 0
    result = run(args)
    print(render_markdown(result))
    if "step_cost" in result:
        report.write_json(result["step_cost"], STEP_COST_PATH)
    return 0 if all("error" not in w for w in result["engines"]) else 1


if __name__ == "__main__":
    sys.exit(main())
