"""What the bfloat16 opt-in (`tiergate serve --dtype bfloat16`) costs in quality and buys in speed on this CPU.

The bundled model reads a passage of real text (bench/data/passages.txt) token by
token, teacher-forced, once in float32 and once in bfloat16, through the engine's
own runner and kernels. At every position we compare the log-probability each
dtype gives the text's actual next token (the drift), whether the two agree on
the most likely token, and the passage's perplexity under each. The decode steps
of that read are timed too, the two dtypes alternating so both see the same load.
bfloat16 is refused on CPUs without native bf16 (AVX-512 BF16 or AMX); there the
bench says so and exits 0.

    .venv/bin/python -m bench.offline.bf16_quality [--tokens 256] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import machine, model_files, paths, report
from bench.common.workload import load_encoder
from engine.config import cpu_has_native_bf16
from engine.loader import load_model
from engine.runner import ModelRunner
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence

BLOCK_SIZE = 16


def read_teacher_forced(runner: ModelRunner, tokens: list[int]) -> tuple[list[torch.Tensor], list[float]]:
    """Log-softmax rows for positions 1..n-1 (each predicting the next text token) and each step's seconds."""
    seq = Sequence("read", tokens[:1])
    seq.block_table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    rows, seconds = [], []
    for position in range(len(tokens) - 1):
        plan = StepPlan([ScheduledChunk(seq=seq, start=position, num_tokens=1)])
        started = time.perf_counter()
        logits = runner.execute(plan)
        seconds.append(time.perf_counter() - started)
        rows.append(torch.log_softmax(logits[0].float(), dim=-1))
        seq.num_computed_tokens = position + 1
        seq.output_token_ids.append(tokens[position + 1])
    return rows, seconds


def measure(num_tokens: int, threads: int) -> dict:
    encode = load_encoder(model_files.hf_dir())
    tokens = encode(paths.PASSAGES.read_text())[:num_tokens]
    blocks = -(-num_tokens // BLOCK_SIZE)
    runners = {name: ModelRunner(load_model("bundled", dtype=dtype), num_blocks=blocks, block_size=BLOCK_SIZE)
               for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    torch.set_num_threads(threads)  # loading leaves this thread serial (engine/cpu_threads.py)
    # Two reads each, alternating; the second read of each is timed, the first warms caches and kernels.
    reads = {}
    for name in ("float32", "bfloat16", "float32", "bfloat16"):
        reads[name] = read_teacher_forced(runners[name], tokens)
    f32, bf16 = reads["float32"][0], reads["bfloat16"][0]
    targets = torch.tensor(tokens[1:])
    lp32 = torch.stack([row[t] for row, t in zip(f32, targets)])
    lp16 = torch.stack([row[t] for row, t in zip(bf16, targets)])
    drift = (lp16 - lp32).abs()
    top_agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(f32, bf16)) / len(f32)
    step = {name: statistics.median(reads[name][1]) for name in reads}
    return {
        "tokens": len(tokens),
        "logprob_drift_mean": drift.mean().item(),
        "logprob_drift_p99": drift.quantile(0.99).item(),
        "logprob_drift_max": drift.max().item(),
        "top1_agreement": top_agree,
        "perplexity_float32": math.exp(-lp32.mean().item()),
        "perplexity_bfloat16": math.exp(-lp16.mean().item()),
        "decode_step_ms": {name: s * 1e3 for name, s in step.items()},
        "decode_speedup": step["float32"] / step["bfloat16"],
        "threads": torch.get_num_threads(),
    }


def render_markdown(result: dict) -> str:
    head = report.measured(result)
    if not result.get("native_bf16", True):
        return head + "\n\nThis CPU has no native bf16 (AVX-512 BF16 or AMX): `--dtype bfloat16` is refused here.\n"
    step = result["decode_step_ms"]
    return "\n".join([
        head, "",
        f"The bundled model reads {result['tokens']} tokens of real text, teacher-forced, through the engine in "
        f"float32 and in bfloat16 (`--dtype bfloat16`); per position, the log-probability of the text's next token.",
        "",
        "| | float32 | bfloat16 |",
        "|---|---:|---:|",
        f"| perplexity of the passage | {result['perplexity_float32']:.3f} | {result['perplexity_bfloat16']:.3f} |",
        f"| batch-1 decode step, median ({result['threads']} threads) | {step['float32']:.1f} ms | "
        f"{step['bfloat16']:.1f} ms |",
        "",
        f"Drift of bfloat16's next-token log-probability from float32's: mean {result['logprob_drift_mean']:.4f}, "
        f"p99 {result['logprob_drift_p99']:.4f}, max {result['logprob_drift_max']:.4f} (nats); the most likely "
        f"token agrees at {result['top1_agreement']:.1%} of positions. bfloat16 decodes one stream "
        f"{result['decode_speedup']:.2f}x as fast as float32. float32 stays the default: it is the dtype that "
        "matches HF transformers within 1e-3.",
        "",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.tokens < 2 or args.threads < 1:
        sys.exit("bf16_quality: --tokens must be at least 2 and --threads at least 1")
    result: dict = {"machine": machine.describe(), "native_bf16": cpu_has_native_bf16()}
    if result["native_bf16"]:
        result.update(measure(args.tokens, args.threads))
    report.finish(result, args.json, render_markdown)


if __name__ == "__main__":
    main()
