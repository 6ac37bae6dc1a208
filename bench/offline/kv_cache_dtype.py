"""The 8-bit KV cache at long contexts (issue 30): tiergate's float32 and Q8_0 pools against llama.cpp's F16
and Q8_0 caches, on the same GGUF files, this CPU.

A decode step at a long context reads its context's keys and values beside the weights: on the bundled
135M model a float32 pool holds 46 KB a token, so 2,000 tokens of context are about as many bytes as the
weights. ``--kv-cache-dtype q8_0`` stores them as llama.cpp's Q8_0 blocks, 3.8x fewer bytes. Each engine
runs in a subprocess of its own (bench/offline/quantized.py's workers), in both of its formats:

- one stream, greedy, after a ``--prompt``-token prompt of real text: tokens/s after the first token
  (the better of two runs), ``--rounds`` rounds alternating the order of formats and engines;
- ``--streams`` streams at the same context (first round only, skipped with ``--streams 0``): decode
  tokens/s once all have their first token, and the KV pool each used.

Printed: each engine's median per format, the gain of tiergate's Q8_0 pool over its float32 pool, and
tiergate against llama.cpp in the same 8-bit format and against llama.cpp's default (F16). llama.cpp's
own check beside it: tokens/s of one-token decodes after a ``--prompt``-token context, timed through its
API as ``llama-bench -d`` runs them (a fresh context, the prompt in 512-token batches, then the decodes).

    .venv/bin/python -m bench.offline.kv_cache_dtype [--models bundled,1b] [--quants q4_k_m] [--prompt 2000]
        [--tokens 128] [--streams 8] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import machine, report
from bench.offline import quantized
from bench.peers import llama_bench

FORMATS = ("auto", "q8_0")  # tiergate: float32 | Q8_0; llama.cpp: F16 | Q8_0
ENGINES = ("tiergate", "llama.cpp")


def _quantized_args(args: argparse.Namespace) -> argparse.Namespace:
    """quantized.py's settings for these runs (its workers read them from their command line)."""
    return quantized.parse_args([
        "--models", args.models, "--quants", args.quants, "--threads", str(args.threads),
        "--single-prompt", str(args.prompt), "--tokens", str(args.tokens), "--streams", str(max(args.streams, 1)),
        "--stream-prompt", str(args.prompt), "--stream-tokens", str(args.stream_tokens), "--tasks", "single,streams"])


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key]["tokens_per_s"] for r in runs if key in r and "tokens_per_s" in r[key]]
    return statistics.median(values) if values else None


def summarize(entry: dict) -> dict:
    """Medians per engine and format, and the ratios the issue asks about."""
    single = {engine: {fmt: _median(entry["runs"][engine][fmt], "single") for fmt in FORMATS} for engine in ENGINES}
    streams = {engine: {fmt: next((r["streams"]["decode"]["tokens_per_s"] for r in entry["runs"][engine][fmt]
                                   if "streams" in r and r["streams"]["decode"]), None) for fmt in FORMATS}
               for engine in ENGINES}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {"single": single, "streams": streams, "ratios": {}}
    for task, table in (("single", single), ("streams", streams)):
        ours, theirs = table["tiergate"], table["llama.cpp"]
        out["ratios"][task] = {"tiergate q8_0 / float32": ratio(ours["q8_0"], ours["auto"]),
                               "tiergate q8_0 / llama.cpp q8_0": ratio(ours["q8_0"], theirs["q8_0"]),
                               "tiergate q8_0 / llama.cpp f16": ratio(ours["q8_0"], theirs["auto"]),
                               "llama.cpp q8_0 / f16": ratio(theirs["q8_0"], theirs["auto"])}
    return out


def llama_depth_check(path: str, threads: int, depth: int, tokens: int, kv_cache_dtype: str) -> dict:
    """llama.cpp's decode tokens/s after ``depth`` tokens of context, as llama-bench's ``tg`` at ``-d depth``:
    the context filled in 512-token batches (not timed), then ``tokens`` one-token decodes timed."""
    import time

    import llama_cpp

    from bench.peers.llama_cpp_runner import KV_TYPES

    llama_bench.LlamaLog()  # its log lines collected, not printed
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = depth + tokens + 16, 512, 512
    params.n_threads = params.n_threads_batch = threads
    if KV_TYPES[kv_cache_dtype] is not None:
        params.type_k = params.type_v = KV_TYPES[kv_cache_dtype]
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    try:
        context = [100 + (i * 37) % 20000 for i in range(depth)]
        for at in range(0, depth, 512):
            llama_bench.llama_decode(ctx, batch, context[at:at + 512], at)
        began = time.perf_counter()
        for i in range(tokens):
            llama_bench.llama_decode(ctx, batch, [200 + i], depth + i)
        return {"tokens_per_s": tokens / (time.perf_counter() - began), "depth": depth, "kv": kv_cache_dtype}
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def run(args: argparse.Namespace) -> dict:
    qargs = _quantized_args(args)
    files = quantized.model_files_for(args.models.split(","), args.quants.split(","))
    workload = {task: [[r.index, r.prompt_token_ids, r.output_len] for r in requests]
                for task, requests in quantized.build_tasks(qargs).items()}
    result = {"machine": machine.describe(), "settings": vars(args), "commit": quantized._commit(), "files": [],
              "complete": False}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
        json.dump(workload, tmp)
    qargs.workload = tmp.name
    try:
        for file in files:
            entry = {**file, "runs": {e: {f: [] for f in FORMATS} for e in ENGINES}}
            result["files"].append(entry)
            for round_no in range(args.rounds):
                tasks = ["single", "streams"] if round_no == 0 and args.streams > 0 else ["single"]
                for fmt in FORMATS if round_no % 2 == 0 else FORMATS[::-1]:
                    for engine in ENGINES if round_no % 2 == 0 else ENGINES[::-1]:
                        qargs.kv_cache_dtype = fmt
                        entry["runs"][engine][fmt].append(quantized._spawn(engine, file["path"], qargs, tasks))
                entry["summary"] = summarize(entry)
                if args.json:
                    report.write_json(result, args.json)
            if "llama.cpp" in ENGINES:
                entry["llama_depth_check"] = {fmt: llama_depth_check(file["path"], args.threads, args.prompt,
                                                                     args.tokens, fmt) for fmt in FORMATS}
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    result["complete"] = True
    if args.json:
        report.write_json(result, args.json)
    return result


def render_markdown(result: dict) -> str:
    lines = [machine.render_markdown(result["machine"])]
    for entry in result["files"]:
        s = entry.get("summary")
        if s is None:
            continue
        lines.append(f"\n{entry['label']}, {result['settings']['prompt']}-token context")
        check = entry.get("llama_depth_check")
        if check:
            lines.append("  llama.cpp's own check (llama-bench tg at this depth), f16/q8_0: "
                         f"{_fmt(check['auto']['tokens_per_s'])}/{_fmt(check['q8_0']['tokens_per_s'])} tokens/s")
        for task, label in (("single", "one stream, tokens/s"), ("streams", f"{result['settings']['streams']} "
                                                                           "streams, decode tokens/s")):
            cells = "  ".join(f"{engine} {'f32' if engine == 'tiergate' else 'f16'}/q8_0: "
                              f"{_fmt(s[task][engine]['auto'])}/{_fmt(s[task][engine]['q8_0'])}" for engine in ENGINES)
            lines.append(f"  {label}: {cells}")
            lines.append("    " + "; ".join(f"{k} {_fmt(v, 2)}x" for k, v in s["ratios"][task].items()))
        for engine in ENGINES:
            for fmt in FORMATS:
                runs = [r for r in entry["runs"][engine][fmt] if "error" not in r]
                kv = next((r["streams"].get("kv") for r in runs if "streams" in r), None)
                errors = [r["error"] for r in entry["runs"][engine][fmt] if "error" in r]
                rss = max((r["peak_rss_mb"] for r in runs), default=None)
                lines.append(f"  {engine} {fmt}: peak RSS {_fmt(rss, 0)} MB; KV at the streams' peak: {kv}"
                             + (f"; errors: {errors}" if errors else ""))
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offline.kv_cache_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled,1b", help=f"comma-separated, of {', '.join(quantized.MODELS)}")
    p.add_argument("--quants", default="q4_k_m", help="for the random shapes")
    p.add_argument("--prompt", type=int, default=2000, help="context tokens before the decode")
    p.add_argument("--tokens", type=int, default=128, help="one stream's tokens")
    p.add_argument("--streams", type=int, default=8, help="streams at the same context (0: none)")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if min(args.prompt, args.tokens, args.rounds, args.threads) < 1 or args.streams < 0 or args.stream_tokens < 2:
        p.error("--prompt, --tokens, --rounds and --threads must be positive, --streams >= 0, --stream-tokens >= 2")
    result = run(args)
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
