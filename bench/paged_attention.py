"""Decode step time with the in-place paged attention kernel against the gathered SDPA path.

The bundled SmolLM2-135M on this CPU: 32 sequences prefill a prompt of
``--prompt`` tokens once into a shuffled block pool (as a pool looks after some
churn); then, for each concurrency level, the first N of them take decode
steps at position ``--prompt``, each step run once through the kernel and once
through the gathered path (order alternating, so both see the same load), both
in this process on the same weights and KV cache. Prints median step times
and the gathered / kernel ratio; a ratio above 1 means the kernel is faster.

    .venv/bin/python -m bench.paged_attention [--concurrency 1,8,32] [--prompt 250]
        [--steps 30] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from bench import machine
from engine.cpu_threads import ThreadTuner
from engine.loader import load_model
from engine.paged_attention import cpu_decode_kernel
from engine.runner import ModelRunner
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence

BLOCK_SIZE = 16  # EngineConfig's default
PREFILL_TOKENS_PER_STEP = 512  # EngineConfig's max_num_batched_tokens


def _prefilled(runner: ModelRunner, count: int, prompt_len: int, seed: int) -> list[Sequence]:
    """``count`` sequences of ``prompt_len + 1`` tokens, all but the last in the cache."""
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    per_seq = (prompt_len + BLOCK_SIZE) // BLOCK_SIZE
    blocks = list(range(count * per_seq))
    rng.shuffle(blocks)
    seqs = []
    for i in range(count):
        seq = Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(prompt_len + 1)])
        seq.block_table = blocks[i * per_seq : (i + 1) * per_seq]
        seqs.append(seq)
    per_step = max(1, PREFILL_TOKENS_PER_STEP // prompt_len)
    for i in range(0, count, per_step):
        runner.execute(StepPlan([ScheduledChunk(seq=s, start=0, num_tokens=prompt_len) for s in seqs[i : i + per_step]]))
    for seq in seqs:
        seq.num_computed_tokens = prompt_len
    return seqs


def _timed_step(runner: ModelRunner, plan: StepPlan, kernel) -> float:
    runner.decode_kernel = kernel
    started = time.perf_counter()
    runner.execute(plan)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    kernel = cpu_decode_kernel()
    if kernel is None:
        raise SystemExit("the C++ paged attention kernel did not build here; see the warning above")
    loaded = load_model("bundled")
    needed = max(args.concurrency) * ((args.prompt + BLOCK_SIZE) // BLOCK_SIZE)
    runner = ModelRunner(loaded, num_blocks=needed, block_size=BLOCK_SIZE, decode_kernel=kernel)
    # One fixed thread count for both paths: the tuner's trials would otherwise mix counts.
    runner.thread_tuner = ThreadTuner([args.threads])
    seqs = _prefilled(runner, max(args.concurrency), args.prompt, seed=0)

    rows = []
    for concurrency in args.concurrency:
        # Each step recomputes position --prompt of every sequence, so the context stays put.
        plan = StepPlan([ScheduledChunk(seq=s, start=args.prompt, num_tokens=1) for s in seqs[:concurrency]])
        times: dict[str, list[float]] = {"kernel": [], "gathered": []}
        for step in range(args.warmup + args.steps):
            order = [("kernel", kernel), ("gathered", None)]
            for name, which in order if step % 2 == 0 else reversed(order):
                elapsed = _timed_step(runner, plan, which)
                if step >= args.warmup:
                    times[name].append(elapsed)
        kernel_ms = statistics.median(times["kernel"]) * 1e3
        gathered_ms = statistics.median(times["gathered"]) * 1e3
        rows.append({"concurrency": concurrency, "kernel_ms": kernel_ms, "gathered_ms": gathered_ms,
                     "ratio": gathered_ms / kernel_ms})
    return {"machine": machine.describe(), "threads": args.threads, "prompt": args.prompt, "steps": args.steps,
            "rows": rows}


def render(result: dict) -> str:
    lines = [f"decode step, {result['prompt']}-token contexts, {result['threads']} thread(s), "
             f"median of {result['steps']} steps each, A/B interleaved",
             f"{'concurrency':>11}  {'kernel ms':>9}  {'gathered ms':>11}  {'gathered/kernel':>15}"]
    for row in result["rows"]:
        lines.append(f"{row['concurrency']:>11}  {row['kernel_ms']:>9.2f}  {row['gathered_ms']:>11.2f}  {row['ratio']:>14.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.prompt < 1 or args.steps < 1 or args.threads < 1:
        parser.error("concurrency, prompt, steps and threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
