"""Quantized GGUF serving: tiergate against llama.cpp on the very same files, this CPU (issue 30).

Files: the bundled SmolLM2-135M (Q4_1, or its F32 copy as ``bundled-f32``) and random-weight ~360M
and ~1B Llama shapes in Q8_0, Q4_0 and Q4_K_M (bench/common/gguf_shapes.py builds them with llama.cpp's
own quantizer). On each file, tiergate (the engine, serving the file as its loader does; the report
names the weight forms it got) and llama.cpp (llama-cpp-python's ``llama_decode``) each run in a
subprocess of their own, so peak RSS is each engine's own:

- single-stream greedy decode of a fixed real-text prompt, tokens/s after the first token (the better of two
  runs, so both engines are measured warm);
- 32 concurrent streams (llama.cpp: one ``llama_batch`` holding every sequence's token, a KV stream
  per sequence, as llama-server's slots): decode tokens/s while all streams run, and end to end;
- pp512: the time to first token of one 512-token prompt, as tokens/s.

Single stream and pp512 run in ``--rounds`` rounds alternating which engine goes first (memory
bandwidth drifts on a shared machine); the report reads each engine's median. Beside each figure,
the bandwidth floor: the file's bytes a decode step reads over the read bandwidth measured here.
llama.cpp's own check: pp512 and tg128 timed through its API as llama-bench runs them.

    .venv/bin/python -m bench.offline.quantized [--models bundled,360m] [--quants q4_k_m] [--full]
        [--rounds 3] [--threads 2] [--json PATH]
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
from collections import Counter
from pathlib import Path

from bench.common import gguf_shapes, machine, model_files, paths, report
from bench.common.stats import percentile
from bench.common.workload import BenchRequest, build_workload, load_encoder
from bench.offline.quantized_report import decode_window, gguf_weight_summary, render_markdown
from bench.peers.llama_bench import PP_TOKENS, LlamaLog, llama_bench_check

MODELS = ("bundled", "bundled-f32", *gguf_shapes.SHAPES)
ENGINES = ("tiergate", "llama.cpp")
TASKS = ("single", "pp512", "streams")
__all__ = ["render_markdown", "main"]


def model_files_for(models: list[str], quants: list[str]) -> list[dict]:
    """(model, quant, label, path) of every file the run covers, built now if not cached."""
    files = []
    for model in models:
        if model == "bundled":
            files.append({"model": model, "quant": "q4_1", "label": "bundled 135M Q4_1",
                          "path": str(model_files.bundled_gguf())})
        elif model == "bundled-f32":
            files.append({"model": model, "quant": "f32", "label": "bundled 135M F32",
                          "path": str(model_files.f32_gguf())})
        else:
            for quant in quants:
                files.append({"model": model, "quant": quant, "label": f"{model.upper()} {quant.upper()}",
                              "path": str(gguf_shapes.random_gguf(model, quant))})
    return files


def build_tasks(args: argparse.Namespace) -> dict[str, list[BenchRequest]]:
    """Every task's requests, real text in the bundled tokenizer (every file shares it)."""
    encode = load_encoder(model_files.hf_dir())
    single = build_workload(encode, 1, (args.single_prompt,) * 2, (args.tokens,) * 2, seed=1)
    pp = build_workload(encode, 1, (PP_TOKENS,) * 2, (1, 1), seed=2)
    streams = build_workload(encode, args.streams, (args.stream_prompt,) * 2, (args.stream_tokens,) * 2, seed=3)
    return {"single": single, "pp512": pp, "streams": streams}


def _read_tasks(path: Path) -> dict[str, list[BenchRequest]]:
    return {task: [BenchRequest(*r) for r in requests] for task, requests in json.loads(path.read_text()).items()}


def _measure(runner, tasks: list[str], workload: dict[str, list[BenchRequest]], pp_reps: int) -> dict:
    """The tasks on a runner of bench/peers (both take ``run(requests, concurrency)``)."""
    out: dict = {}
    if "single" in tasks:
        # The better of two runs: llama.cpp's runner makes a fresh context per run, whose first steps
        # stall on buffers touched for the first time (one 64-token run at 103 tok/s, the next at 135),
        # while a server's context, as tiergate's engine here, is warm.
        timing = min((runner.run(workload["single"], 1).timings[0] for _ in range(2)), key=lambda t: t.tpot_s)
        out["single"] = {"tokens_per_s": 1 / timing.tpot_s, "ttft_s": timing.ttft_s, "tokens": timing.output_tokens}
    if "pp512" in tasks:
        ttfts = [runner.run(workload["pp512"], 1).timings[0].ttft_s for _ in range(pp_reps)]
        out["pp512"] = {"tokens_per_s": PP_TOKENS / statistics.median(ttfts), "reps_s": ttfts}
    if "streams" in tasks:
        requests = workload["streams"]
        result = runner.run(requests, len(requests))
        ttft = [t.ttft_s for t in result.timings]
        out["streams"] = {"e2e_tokens_per_s": result.output_tokens_per_s, "wall_s": result.wall_s,
                          "decode": decode_window(runner.token_times),
                          "ttft_p50_s": percentile(ttft, 50), "ttft_max_s": max(ttft),
                          "extra": {k: v for k, v in result.extra.items() if k != "threads_chosen"}}
    return out


def describe_weights(model) -> dict:
    """What the engine holds: its packed projections by form (and block type, where quantized) and
    every tensor's bytes by dtype, each storage counted once (a tied head shares the embedding)."""
    import torch

    from engine.packed_linear import PackedWeight

    forms: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    seen: set[int] = set()  # tensors' data pointers
    packed: set[int] = set()  # packed weights' ids
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, PackedWeight) and id(value) not in packed:  # a tied head is the embedding
                packed.add(id(value))
                # A fused group (q|k|v, gate|up) of quantized parts may mix block types.
                kinds = [getattr(part, "ggml_type", None) for part in getattr(value, "parts", [value])]
                names = sorted({getattr(k, "name", str(k)) for k in kinds if k is not None})
                label = " ".join([value.form, "+".join(names)]) if names else value.form
                forms[label] += 1
                by_kind[label] += value.nbytes
            elif isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                by_kind[str(value.dtype).removeprefix("torch.")] += value.nbytes
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                by_kind[str(tensor.dtype).removeprefix("torch.")] += tensor.nbytes
    return {"forms": dict(forms.most_common()), "by_kind": dict(by_kind.most_common()), "bytes": sum(by_kind.values())}


def _tiergate_worker(path: Path, args: argparse.Namespace, workload: dict, tasks: list[str]) -> dict:
    from bench.peers.tiergate_runner import TiergateRunner

    if args.pin_threads:
        os.environ["TIERGATE_CPU_THREADS"] = str(args.threads)
    started = time.perf_counter()
    context = max(args.single_prompt + args.tokens, PP_TOKENS + 1, args.stream_prompt + args.stream_tokens)
    # The pool holds every stream's context, so no run preempts (llama.cpp's n_ctx is sized alike).
    runner = TiergateRunner(args.streams, -(-(args.stream_prompt + args.stream_tokens) // 256) * 256,
                            model=str(path), max_model_len=max(2048, context), kv_cache_dtype=args.kv_cache_dtype)
    if runner.engine.num_kv_blocks * runner.config.block_size < context:
        raise RuntimeError("the KV pool cannot hold the longest request (--single-prompt, pp512)")
    try:
        runner.warm_up()
        out = {"load_s": time.perf_counter() - started, "weights": describe_weights(runner.engine.runner.model)}
        out.update(_measure(runner, tasks, workload, args.pp_reps))
        if "streams" in out:
            x = out["streams"]["extra"]
            dtype = str(runner.engine.runner.kv_cache.layers[0].dtype).removeprefix("torch.")
            dtype = "q8_0" if dtype == "uint8" else dtype
            x["kv"] = (f"peak {x['kv_blocks_peak']}/{x['kv_blocks_total']} blocks of {runner.config.block_size} "
                       f"tokens, {dtype}")
            out["streams"]["kv"] = x["kv"]
        return out
    finally:
        runner.close()


def _llama_worker(path: Path, args: argparse.Namespace, workload: dict, tasks: list[str]) -> dict:
    import llama_cpp

    from bench.peers.llama_cpp_runner import LlamaCppRunner

    log = LlamaLog()
    started = time.perf_counter()
    runner = LlamaCppRunner(path, path.stem, args.threads, pin_threads=args.pin_threads,
                            kv_cache_dtype=args.kv_cache_dtype)
    runner.warm_up()
    out = {"load_s": time.perf_counter() - started, "buffers": log.lines(),
           "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    out.update(_measure(runner, tasks, workload, args.pp_reps))
    if "streams" in out:
        kv = [line for line in log.lines() if "KV buffer size" in line]
        out["streams"]["kv"] = kv[-1] if kv else None
    if "pp512" in tasks:
        out["llama_bench"] = llama_bench_check(path, args.threads)
    return out


def run_worker(engine: str, path: Path, args: argparse.Namespace, tasks: list[str]) -> dict:
    import psutil

    worker = _tiergate_worker if engine == "tiergate" else _llama_worker
    out = {"engine": engine, "tasks": tasks, **worker(path, args, _read_tasks(Path(args.workload)), tasks)}
    # ru_maxrss is in KiB on Linux: the process's peak over load and every task.
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["rss_at_end_mb"] = psutil.Process().memory_info().rss / 2**20
    return out


_SETTINGS = ("threads", "tokens", "single_prompt", "streams", "stream_prompt", "stream_tokens", "pp_reps",
             "kv_cache_dtype")


def _spawn(engine: str, path: str, args: argparse.Namespace, tasks: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.offline.quantized", "--worker", engine, "--file", path,
           "--tasks", ",".join(tasks), "--workload", args.workload]
    for name in _SETTINGS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if not args.pin_threads:
        cmd.append("--tune-threads")
    print(f"quantized: {engine} on {Path(path).name}: {','.join(tasks)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.worker_timeout,
                              cwd=paths.ROOT)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {args.worker_timeout} s"}
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"engine": engine, "error": f"worker exited with {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shown = {k: round(v["tokens_per_s"], 1) for k, v in result.items() if isinstance(v, dict) and "tokens_per_s" in v}
    print(f"  {engine}: {shown}", file=sys.stderr, flush=True)
    return result


def run(args: argparse.Namespace) -> dict:
    files = model_files_for(args.models.split(","), args.quants.split(","))  # built before anything is timed
    engines = args.engines.split(",")
    workload = {task: [[r.index, r.prompt_token_ids, r.output_len] for r in requests]
                for task, requests in build_tasks(args).items()}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
        json.dump(workload, tmp)
    args.workload = tmp.name
    try:
        return _run_files(args, files, engines)
    finally:
        Path(tmp.name).unlink(missing_ok=True)


def _commit() -> str | None:
    """The checkout's commit, and whether its engine or bench differ from it: the weight forms
    tiergate serves change from commit to commit."""
    root = paths.ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "engine", "bench"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" with uncommitted changes" if dirty else "")


def _run_files(args: argparse.Namespace, files: list[dict], engines: list[str]) -> dict:
    from bench.offline.engine_throughput import read_bandwidth_gbs

    result = {"machine": machine.describe(), "threads": args.threads, "commit": _commit(),
              "settings": {**{n: getattr(args, n) for n in _SETTINGS}, "rounds": args.rounds,
                           "pin_threads": args.pin_threads},
              "bandwidth_gbs": {"start": read_bandwidth_gbs(args.threads), "end": None},
              "files": [], "complete": False}
    for file in files:
        entry = {**file, "weights": gguf_weight_summary(Path(file["path"])), "engines": {e: [] for e in engines}}
        result["files"].append(entry)
        for round_no in range(args.rounds):
            tasks = [t for t in (TASKS if round_no == 0 else ("single", "pp512")) if t in args.tasks.split(",")]
            for engine in engines if round_no % 2 == 0 else engines[::-1]:
                entry["engines"][engine].append(_spawn(engine, file["path"], args, tasks))
            if args.json:  # after every round, so a bench cut short keeps what it measured
                report.write_json(result, args.json)
    result["bandwidth_gbs"]["end"] = read_bandwidth_gbs(args.threads)
    result["complete"] = True
    if args.json:
        report.write_json(result, args.json)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offline.quantized", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled,360m", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--quants", default="q4_k_m", help=f"for the random shapes, of {', '.join(gguf_shapes.QUANTS)}")
    p.add_argument("--full", action="store_true", help="bundled, 360m and 1b in every quantization")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--rounds", type=int, default=3, help="rounds of single stream and pp512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tune-threads", dest="pin_threads", action="store_false",
                   help="let each engine pick 1..threads per step size by timing (as `tiergate serve` does)")
    p.add_argument("--tokens", type=int, default=128, help="single-stream tokens")
    p.add_argument("--single-prompt", type=int, default=32, help="single-stream prompt tokens (2000: a long context)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--pp-reps", type=int, default=3)
    p.add_argument("--kv-cache-dtype", choices=["auto", "q8_0"], default="auto",
                   help="both engines' KV cache: auto (tiergate float32, llama.cpp F16) or q8_0 (both 8-bit)")
    p.add_argument("--worker-timeout", type=int, default=1800)
    p.add_argument("--json")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"of {', '.join(TASKS)} (streams run in the first round only)")
    args = p.parse_args(argv)
    if args.full:
        args.models, args.quants = "bundled,360m,1b", ",".join(gguf_shapes.QUANTS)
    for flag, chosen, known in (("--models", args.models, MODELS), ("--quants", args.quants, gguf_shapes.QUANTS),
                                ("--engines", args.engines, ENGINES), ("--tasks", args.tasks, TASKS)):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            p.error(f"{flag}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    if min(args.rounds, args.threads, args.tokens, args.streams, args.stream_tokens, args.pp_reps) < 1 \
            or args.tokens < 2 or args.stream_tokens < 2:
        p.error("--rounds, --threads, --streams and --pp-reps must be positive; --tokens and --stream-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, Path(args.file), args, args.tasks.split(","))))
        return 0
    result = run(args)
    print(render_markdown(result))
    failed = any("error" in r for f in result["files"] for rounds in f["engines"].values() for r in rounds)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
