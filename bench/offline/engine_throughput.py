"""Engine throughput: tiergate against HF transformers and llama.cpp on the bundled model, this CPU.

A fixed seeded workload (64 requests, prompts 20-400 tokens of real text,
outputs 16-256 tokens, greedy, EOS ignored so every length is exact) runs at
each concurrency level through every engine: tiergate (fcfs, continuous
batching), HF transformers `generate` (float32; static left-padded batches
above concurrency 1), llama.cpp on an F32 GGUF of the very same weights and,
for reference only, on the Q4_1 original. Each engine runs in its own
subprocess so its peak RSS is its own. Prints a table and tiergate's ratio to
each peer; writes JSON and the step-time cost model fitted to tiergate's
steps (bench/out/step_cost.json, read by bench/slo_sim.py). With
``--single-stream-rounds R``, tiergate and llama.cpp-F32 run concurrency 1 in
R - 1 more rounds, alternating which goes first, and the single-stream goal
reads the median ratio (both are bound by a memory bandwidth that drifts on a
shared VM; see ``_single_stream_rounds``).

    .venv/bin/python -m bench.engine_throughput [--requests 64] [--concurrency 1,8,32]
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

from bench import machine, model_files
from bench.workload import BenchRequest, build_workload, load_encoder

# tiergate-plain is tiergate with its projections on torch.mm (TIERGATE_PACKED_WEIGHTS=0) and its
# decode attention over a gathered copy of the context (TIERGATE_PAGED_ATTENTION=off), as before
# the packed weights and the paged kernel: the engine issue's "today's tiergate", in the same run.
# tiergate-onednn packs its projections for oneDNN instead of tiergate's panel kernel (the
# fallback when the kernel cannot be built), to show what the kernel adds.
ENGINES = ("tiergate", "llama.cpp-F32", "llama.cpp-Q4_1", "hf-transformers", "tiergate-plain", "tiergate-onednn")
PEERS = ENGINES[1:]
OUT_DIR = Path(__file__).parent / "out"
STEP_COST_PATH = OUT_DIR / "step_cost.json"


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
        runner = TiergateRunner(max_concurrency, _context_per_sequence(requests))
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
        from bench.step_cost import fit_step_cost

        out["step_cost"] = fit_step_cost(runner.steps)
        out["step_cost"]["num_layers"] = runner.engine.model_config.num_layers
        out["step_cost"]["source"] = "tiergate engine steps of this run (bundled model, this CPU)"
    if engine.startswith("tiergate"):
        runner.close()
    return out


def _spawn_worker(engine: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, "-m", "bench.engine_throughput", "--worker", engine, "--out", tmp.name,
               "--requests", str(args.requests), "--concurrency", args.concurrency, "--seed", str(args.seed),
               "--prompt-len", args.prompt_len, "--output-len", args.output_len,
               "--threads", str(args.threads)]
        if args.single_stream_requests:
            cmd += ["--single-stream-requests", str(args.single_stream_requests)]
        proc = subprocess.run(cmd, stdout=sys.stderr, cwd=Path(__file__).parent.parent)
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
            Path(args.json).write_text(json.dumps(result, indent=2))
    if args.single_stream_rounds > 1 and {"tiergate", "llama.cpp-F32"} <= set(engines) and 1 in result["concurrency"]:
        result["single_stream_rounds"] = _single_stream_rounds(args, result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
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


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def render_markdown(result: dict) -> str:
    """The results as markdown tables: one row per engine and concurrency, then the ratios."""
    w = result.get("workload", {})
    lines = [
        f"Measured {machine.render_markdown(result['machine'])}." if "machine" in result else "",
        "" if result.get("complete", True) else "\n**Partial run: the engines missing below did not finish.**\n",
        f"Workload: {w.get('requests')} requests (seed {w.get('seed')}), prompts {w.get('prompt_len')} tokens, "
        f"outputs {w.get('output_len')} tokens, greedy, EOS ignored; concurrency 1 runs the first "
        f"{w.get('single_stream_requests')} requests; {result.get('threads')} threads for each peer, and tiergate "
        "picks 1 or more up to that by timing its own steps, as `tiergate serve` does. tiergate: fcfs policy, "
        "prefix cache off (levels replay the same prompts), KV pool sized like llama.cpp's n_ctx. "
        "HF: float32 `generate`, static left-padded batches of the concurrency level, each request credited only "
        "its own tokens. llama.cpp: F32 GGUF of the same weights (Q4_1 for reference), driven as llama-server's "
        "slots are at every level: `llama_decode` with one sequence and KV stream per slot, lowest free id first, "
        "tokens in ascending id order, continuous joining, and 1 or more threads per step size picked by timing "
        "its steps (bench/peers/llama_cpp_runner.py). tiergate-plain: tiergate with TIERGATE_PACKED_WEIGHTS=0, "
        "TIERGATE_PAGED_ATTENTION=off and TIERGATE_FUSED_NORMS=0 (projections on torch.mm, attention through "
        "SDPA with decodes over a gathered copy, norms, rope and the SiLU gate as torch ops: the engine before "
        "issue 16); "
        "tiergate-onednn: tiergate with its projections packed for oneDNN instead of its own panel kernel.",
        "",
        "| engine | concurrency | requests | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | peak RSS (MB) | KV peak use | KV waste |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for w in result["engines"]:
        if "error" in w:
            lines.append(f"| {w['engine']} | - | - | {w['error']} | | | | | |")
            continue
        for run in w["runs"]:
            s = run["summary"]
            kv_use = f"{s['kv_blocks_peak']}/{s['kv_blocks_total']}" if "kv_blocks_peak" in s else "-"
            kv_waste = f"{s['kv_waste']:.1%}" if s.get("kv_waste") is not None else "-"
            lines.append(
                f"| {w['engine']} | {s['concurrency']} | {s['requests']} | {s['output_tokens_per_s']:.1f} "
                f"| {_fmt(s['ttft_p50_s'], digits=2)} / {_fmt(s['ttft_p99_s'], digits=2)} "
                f"| {_fmt(s['tpot_p50_s'], 1e3)} / {_fmt(s['tpot_p99_s'], 1e3)} "
                f"| {w['peak_rss_mb']:.0f} | {kv_use} | {kv_waste} |"
            )
    concurrencies = result["concurrency"]
    lines += ["", "tiergate output tokens/s over each peer's:", "",
              "| peer | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
              "|---|" + "---:|" * len(concurrencies)]
    for peer, by_c in result["ratios"].items():
        lines.append(f"| {peer} | " + " | ".join(
            f"{by_c[str(c)]:.2f}x" if str(c) in by_c else "-" for c in concurrencies) + " |")
    lines += ["", *_goal_lines(result)]
    cost = result.get("step_cost")
    if cost:
        lines += ["", f"Step-time cost model fitted to {cost['steps']} tiergate steps (R² {cost['r2']:.3f}): "
                      f"{cost['base_s'] * 1e3:.2f} ms + {cost['per_prefill_token_s'] * 1e6:.1f} µs/prefill token "
                      f"+ {cost['per_decode_seq_s'] * 1e3:.2f} ms/decode row "
                      f"+ {cost['per_context_token_s'] * 1e9:.1f} ns/context token."]
    return "\n".join(lines) + "\n"


GOALS = (  # (concurrency, peer, least ratio) from the engine issue (16)
    (1, "llama.cpp-F32", 1.0),
    (32, "llama.cpp-F32", 1.5),
    (32, "tiergate-plain", 2.5),
    (32, "hf-transformers", 2.0),
)


def _floor_lines(result: dict) -> list[str]:
    """The best batch-1 decode step memory allows, and how close each engine's single stream came."""
    if "read_bandwidth_gbs" not in result:  # runs from before the read-bandwidth measure
        floor = result["copy_bandwidth_gbs"] * 1e9 / result["f32_weight_bytes"]
        return [f"Memory-bandwidth floor of single-stream float32 decode: {result['f32_weight_bytes'] / 1e6:.0f} MB "
                f"of weights read per token at {result['copy_bandwidth_gbs']:.1f} GB/s (copy bandwidth) = "
                f"{floor:.1f} tok/s.", ""]
    floor_s = result["decode_weight_bytes"] / (result["read_bandwidth_gbs"] * 1e9)
    lines = [f"Memory-bandwidth floor of a batch-1 float32 decode step: {result['decode_weight_bytes'] / 1e6:.0f} MB of "
             f"weights read per step at {result['read_bandwidth_gbs']:.1f} GB/s (read bandwidth measured in this run, "
             f"{result['threads']} threads; copy bandwidth {result['copy_bandwidth_gbs']:.1f} GB/s) = "
             f"{floor_s * 1e3:.1f} ms per step, {1 / floor_s:.1f} tok/s at best."]
    for w in result["engines"]:
        single = next((r["summary"] for r in w.get("runs", []) if r["summary"]["concurrency"] == 1), None)
        if single and single.get("tpot_p50_s"):
            lines.append(f"- {w['engine']} at batch 1: TPOT p50 {single['tpot_p50_s'] * 1e3:.1f} ms, "
                         f"{floor_s / single['tpot_p50_s']:.0%} of the floor.")
    return lines + [""]


def _goal_lines(result: dict) -> list[str]:
    lines = _floor_lines(result)
    rounds = result.get("single_stream_rounds")
    if rounds and rounds["ratios"]:
        lines.append(f"- single-stream rounds, tiergate over llama.cpp-F32, alternating which runs first: "
                     f"{', '.join(f'{r:.2f}x' for r in rounds['ratios'])}; median {rounds['median']:.2f}x "
                     "(the c=1 goal below reads the median).")
    for c, peer, least in GOALS:
        ratio = result["ratios"].get(peer, {}).get(str(c))
        if c == 1 and peer == "llama.cpp-F32" and rounds and rounds["median"] is not None:
            ratio = rounds["median"]
        if ratio is None:
            lines.append(f"- goal at c={c}: at least {least}x {peer}: not measured in this run.")
        else:
            verdict = "met" if ratio >= least else "**not met**"
            lines.append(f"- goal at c={c}: at least {least}x {peer}: {ratio:.2f}x, {verdict}.")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine_throughput", description=__doc__.split("\n\n")[0])
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
        Path(args.out).write_text(json.dumps(result))
        return 0
    result = run(args)
    print(render_markdown(result))
    if "step_cost" in result:
        OUT_DIR.mkdir(exist_ok=True)
        STEP_COST_PATH.write_text(json.dumps(result["step_cost"], indent=2))
    return 0 if all("error" not in w for w in result["engines"]) else 1


if __name__ == "__main__":
    sys.exit(main())
