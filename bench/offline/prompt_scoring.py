"""Prompt scoring (prompt logprobs, as evaluation harnesses ask for them): tiergate against HF
transformers and llama.cpp on the bundled model's float32 weights, this CPU.

Every engine scores the same seeded prompts of real text: for each prompt token but the first, its
logprob after the tokens before it and whether it was the likeliest token (what lm-evaluation-harness
reads from ``echo`` with ``logprobs: 1``). The report gives prompt tokens scored per second, tiergate's
ratio to each peer, each engine's peak RSS, and how far each peer's summed logprob of a prompt is
from tiergate's, so a ratio is one of like work. Each engine runs in its own subprocess.

- tiergate: the engine, every prompt submitted at once with ``max_tokens: 1`` and
  ``prompt_logprobs: 0`` (rank included); its scheduler packs prompt chunks into its 512-token steps.
- hf-transformers: one float32 forward per prompt (no padding to waste), inference mode, then a
  log-softmax over every position's logits.
- llama.cpp-F32: ``llama_decode`` over batches of up to 512 tokens packed from consecutive prompts
  (one sequence id each, a unified KV cache), logits on for every token as llama-server computes
  ``echo`` logprobs, then the same log-softmax on ``llama_get_logits``. As a check of the peer, its
  pp512 time as llama-bench measures it (one 512-token batch, the last token's logits only) is
  printed beside it.

    .venv/bin/python -m bench.offline.prompt_scoring [--prompts 32] [--prompt-len 64,512] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, model_files, report
from bench.common.workload import BenchRequest, build_workload, load_encoder

ENGINES = ("tiergate", "hf-transformers", "llama.cpp-F32")
BATCH_TOKENS = 512


def _score_rows(logits, targets):
    """(summed logprob of ``targets``, how many were the likeliest) from ``[rows, vocab]`` logits."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    greedy = (logprobs.argmax(dim=-1) == targets).sum()
    return float(chosen.sum()), int(greedy)


def run_tiergate(prompts: list[list[int]], model: str = "bundled") -> tuple[float, list[float]]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import EngineRequest, SamplingParams

    longest = max(len(p) for p in prompts) + 1
    # float32 (the file's values exactly), as HF and llama.cpp-F32 here read them and score against:
    # with no dtype a GGUF on CPU is served in its own Q4_1 blocks.
    engine = Engine(EngineConfig(model=model, policy="fcfs", num_kv_blocks=len(prompts) * -(-longest // 16),
                                 max_num_seqs=len(prompts), enable_prefix_caching=False, dtype="float32")).start()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine.generate_batch_sync([EngineRequest("warm-up", prompts[0][:16], params)])

    async def one(i: int, prompt: list[int]) -> float:
        async for delta in engine.generate(EngineRequest(f"p{i}", prompt, params)):
            if delta.error:
                raise RuntimeError(delta.error)
            if delta.prompt_logprobs is not None:
                return sum(s.logprob for s in delta.prompt_logprobs[1:])
        raise RuntimeError(f"prompt {i} came back without its scores")

    async def all_prompts() -> list[float]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        began = time.perf_counter()
        sums = asyncio.run(all_prompts())
        return time.perf_counter() - began, sums
    finally:
        engine.shutdown()


def run_hf(prompts: list[list[int]], threads: int, model_dir: Path | None = None) -> tuple[float, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir or model_files.hf_dir(), dtype=torch.float32).eval()
    with torch.inference_mode():
        model(torch.tensor([prompts[0][:16]]))
        began = time.perf_counter()
        sums = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            sums.append(_score_rows(model(ids).logits[0, :-1], ids[0, 1:])[0])
        return time.perf_counter() - began, sums


def run_llama_cpp(prompts: list[list[int]], threads: int) -> tuple[float, list[float], float]:
    import llama_cpp
    import numpy as np
    import torch

    model = llama_cpp.llama_model_load_from_file(str(model_files.f32_gguf()).encode(),
                                                 llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 2 * BATCH_TOKENS + max(len(p) for p in prompts)
    params.n_batch = params.n_ubatch = BATCH_TOKENS
    params.n_seq_max = 64
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True  # sequences of one batch share a micro-batch
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)

    def decode(tokens: list[tuple[int, int, int, bool]]) -> None:
        for n, (token, pos, seq_id, logits) in enumerate(tokens):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
            batch.seq_id[n][0], batch.logits[n] = seq_id, logits
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        pp_tokens = (prompts[0] * BATCH_TOKENS)[:BATCH_TOKENS]
        decode([(t, p, 0, p == BATCH_TOKENS - 1) for p, t in enumerate(pp_tokens)])  # warm-up
        llama_cpp.llama_memory_clear(memory, True)
        began = time.perf_counter()
        decode([(t, p, 0, p == BATCH_TOKENS - 1) for p, t in enumerate(pp_tokens)])  # llama-bench's pp512
        pp512_s = time.perf_counter() - began
        llama_cpp.llama_memory_clear(memory, True)

        sums = [0.0] * len(prompts)
        began = time.perf_counter()
        pending = [(i, pos) for i, p in enumerate(prompts) for pos in range(len(p))]
        for start in range(0, len(pending), BATCH_TOKENS):
            rows = pending[start:start + BATCH_TOKENS]
            decode([(prompts[i][pos], pos, i % params.n_seq_max, True) for i, pos in rows])
            logits = torch.from_numpy(np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(rows), vocab)))
            scored = [(k, i, pos) for k, (i, pos) in enumerate(rows) if pos + 1 < len(prompts[i])]
            for i in {i for _, i, _ in scored}:
                picks = [(k, pos) for k, j, pos in scored if j == i]
                targets = torch.tensor([prompts[i][pos + 1] for _, pos in picks])
                sums[i] += _score_rows(logits[[k for k, _ in picks]], targets)[0]
            for i in {i for i, pos in rows if pos == len(prompts[i]) - 1}:  # a prompt done: its KV goes
                llama_cpp.llama_memory_seq_rm(memory, i % params.n_seq_max, -1, -1)
        return time.perf_counter() - began, sums, pp512_s
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def run_worker(engine: str, prompts: list[list[int]], threads: int) -> dict:
    if engine == "tiergate":
        wall, sums = run_tiergate(prompts)
        extra = {}
    elif engine == "hf-transformers":
        wall, sums = run_hf(prompts, threads)
        extra = {}
    elif engine == "llama.cpp-F32":
        wall, sums, pp512_s = run_llama_cpp(prompts, threads)
        extra = {"pp512_tokens_per_s": BATCH_TOKENS / pp512_s}
    else:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    scored = sum(len(p) - 1 for p in prompts)
    return {"engine": engine, "wall_s": wall, "scored_tokens": scored, "tokens_per_s": scored / wall,
            "prompt_sums": sums, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    requests: list[BenchRequest] = build_workload(load_encoder(model_files.hf_dir()), args.prompts, (lo, hi), (1, 1))
    return [r.prompt_token_ids for r in requests]


def _worker(engine: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.offline.prompt_scoring", "--worker", engine,
                          "--prompts", str(args.prompts), "--prompt-len", args.prompt_len,
                          "--threads", str(args.threads)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.splitlines()[-1])
    print(f"  {engine}: {result['tokens_per_s']:.0f} tokens scored/s", file=sys.stderr, flush=True)
    return result


def run(args: argparse.Namespace) -> dict:
    # Rounds alternate the engines' order (ABC, CBA, ...) and each engine's median round is
    # reported, so a shared machine's drift falls on every engine alike.
    engines = args.engines.split(",")
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for i in range(args.rounds):
        for engine in engines if i % 2 == 0 else engines[::-1]:
            runs[engine].append(_worker(engine, args))
    results = {}
    for engine, rounds in runs.items():
        median = sorted(rounds, key=lambda r: r["tokens_per_s"])[(len(rounds) - 1) // 2]
        results[engine] = {**median, "rounds_tokens_per_s": [r["tokens_per_s"] for r in rounds]}
    ours = results.get("tiergate")
    for result in results.values():
        if ours is not None and result is not ours:
            result["ratio"] = ours["tokens_per_s"] / result["tokens_per_s"]
            result["max_sum_diff"] = max(abs(a - b) for a, b in zip(result["prompt_sums"], ours["prompt_sums"]))
    return {"machine": machine.describe(), "prompts": args.prompts, "prompt_len": args.prompt_len,
            "threads": args.threads, "rounds": args.rounds, "engines": results}


def render_markdown(result: dict) -> str:
    lines = [machine.render_markdown(result["machine"]), "",
             f"{result['prompts']} prompts of {result['prompt_len'].replace(',', '-')} tokens, {result['threads']} threads, "
             f"each engine's median of {result['rounds']} rounds (engines alternating order).",
             "", "| engine | prompt tokens scored/s | each round | tiergate / engine | peak RSS MB "
                 "| max diff of a prompt's summed logprob |",
             "|---|---:|---|---:|---:|---:|"]
    for name, r in result["engines"].items():
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        diff = f"{r['max_sum_diff']:.1e}" if "max_sum_diff" in r else "-"
        each = ", ".join(f"{v:.0f}" for v in r["rounds_tokens_per_s"])
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {each} | {ratio} | {r['peak_rss_mb']:.0f} | {diff} |")
    llama = result["engines"].get("llama.cpp-F32")
    if llama is not None:
        lines += ["", f"Peer check: llama.cpp's pp512 (llama-bench's shape: the last token's logits only) "
                      f"{llama['pp512_tokens_per_s']:.0f} tokens/s in the same process."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", default="64,512")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, _prompts(args), args.threads)))
        return 0
    result = run(args)
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
