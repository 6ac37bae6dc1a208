"""Decode step time with the in-place paged attention kernel against the gathered SDPA path.

The bundled SmolLM2-135M on this CPU: 32 sequences prefill a prompt of
``--prompt`` tokens once into a shuffled block pool (as a pool looks after some
churn); then, for each concurrency level, the first N of them take decode
steps at position ``--prompt``, each step run once through the kernel and once
through the gathered path (order alternating, so both see the same load), both
in this process on the same weights and KV cache, and a third time through the kernel with each
layer's RoPE, KV write and attention as separate calls ("separate"; the kernel's step makes them one
call, attention.rope_decode_attention), and a fourth with the output and down projections' residual add
and norm apart ("join apart"; quantized weights take them into the projection's call); with ``--native`` a
fifth with each layer's calls apart ("layer apart"; the kernel's step makes a quantized layer's whole decode
one call, csrc/quant_decode_layer.cpp), the reference of the two before it. Then the same for one
layer's attention call alone (cache flushed between calls, as the rest of a
step flushes it). ``--long-prompt N``: the first sequence's context is N tokens
instead, a long context among short ones (how the kernel shares uneven work
among its threads). Prints median times and the gathered / kernel ratio; a ratio
above 1 means the kernel is faster. Last, one layer's causal attention of a
whole prompt of each ``--prefill-lengths`` length, the prefill kernel
(csrc/prefill_attention.cpp) against SDPA, alternating the same way.

``--native``: the bundled file's weights as the engine serves them (quantized), not dequantized.

    .venv/bin/python -m bench.kernels.paged_attention [--concurrency 1,8,32] [--prompt 250]
        [--long-prompt N] [--prefill-lengths 64,250,1000] [--steps 30] [--threads N] [--native] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.common import machine, report
from engine.attention import AttentionMetadata, LayerAttention, paged_attention
from engine.cpu_threads import ThreadTuner
from engine.loader import load_model
from engine.attention_kernels import cpu_decode_kernel, prefill_kernel_for
from engine.runner import ModelRunner
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence

BLOCK_SIZE = 16  # EngineConfig's default
PREFILL_TOKENS_PER_STEP = 512  # EngineConfig's max_num_batched_tokens


def _blocks_for(length: int) -> int:
    """KV blocks of a sequence whose context is ``length`` tokens, with room for the token it decodes."""
    return (length + BLOCK_SIZE) // BLOCK_SIZE


def _prefilled(runner: ModelRunner, lengths: list[int], seed: int) -> list[Sequence]:
    """A sequence of ``n + 1`` tokens for each ``n`` of ``lengths``, all but the last in the cache."""
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    blocks = list(range(sum(_blocks_for(n) for n in lengths)))
    rng.shuffle(blocks)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(n + 1)])
        seq.block_table, blocks = blocks[: _blocks_for(n)], blocks[_blocks_for(n) :]
        seqs.append(seq)
    step: list[ScheduledChunk] = []
    for seq, n in zip(seqs, lengths):
        if step and sum(c.num_tokens for c in step) + n > PREFILL_TOKENS_PER_STEP:
            runner.execute(StepPlan(step))
            step = []
        step.append(ScheduledChunk(seq=seq, start=0, num_tokens=n))
    runner.execute(StepPlan(step))
    for seq, n in zip(seqs, lengths):
        seq.num_computed_tokens = n
    return seqs


def _run(runner: ModelRunner, plan: StepPlan, kernel, rope: list[bool], join: list[bool], calls: list) -> None:
    """One decode step; a layer whose ``rope`` is False keeps its RoPE, KV write and attention as separate
    calls, one whose ``join`` is False its projections' residual add and norm (``DecoderLayer.plain_rope`` and
    ``plain_join`` let a layer make them one call each; either off also takes the layer out of ``calls``,
    its whole decode step as one call, ``DecoderLayer.decode_call``, None for a layer without)."""
    runner.decode_kernel = kernel
    for layer, plain_rope, plain_join, call in zip(runner.model.layers, rope, join, calls):
        layer.plain_rope, layer.plain_join, layer.decode_call = plain_rope, plain_join, call
    runner.execute(plan)


def _interleaved(calls: dict[str, Callable[[], object]], rounds: int, warmup: int,
                 between: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of each call, run in alternating order each round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for i in range(warmup + rounds):
        for name in order if i % 2 == 0 else reversed(order):
            if between is not None:
                between()
            started = time.perf_counter()
            calls[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def _attention_alone(runner: ModelRunner, plan: StepPlan, kernel, rounds: int) -> dict[str, float]:
    """One layer's decode attention for the plan's rows, kernel against gathered."""
    cfg = runner.config
    specs = [(c.start, 1, c.seq.block_table) for c in plan.chunks]
    q = torch.randn(len(specs), cfg.num_heads, cfg.head_dim)
    kv = torch.randn(len(specs), 2, cfg.num_kv_heads, cfg.head_dim)
    layer = runner.kv_cache.layers[0]
    metas = {name: AttentionMetadata.build(specs, BLOCK_SIZE, "cpu", k) for name, k in (("kernel", kernel), ("gathered", None))}
    flush = torch.empty(64 * 2**20 // 4)  # larger than the L3 cache
    attention = LayerAttention(cfg.head_dim**-0.5)
    calls = {name: (lambda m=meta: paged_attention(q, kv, layer, m, attention)) for name, meta in metas.items()}
    return _interleaved(calls, rounds, warmup=3, between=lambda: flush.add_(1.0))


@torch.inference_mode()
def _prefill_alone(runner: ModelRunner, length: int, rounds: int) -> dict[str, float]:
    """One layer's causal attention over a ``length``-token prompt, prefill kernel against SDPA."""
    cfg = runner.config
    kernel = prefill_kernel_for("cpu", torch.float32, cfg.head_dim)
    if kernel is None:
        raise SystemExit("the C++ prefill attention kernel did not build here; see the warning above")
    blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    specs = [(0, length, list(range(blocks)))]
    q = torch.randn(length, cfg.num_heads, cfg.head_dim)
    kv = torch.randn(length, 2, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.zeros(blocks, BLOCK_SIZE, 2, cfg.num_kv_heads, cfg.head_dim)
    attention = LayerAttention(cfg.head_dim**-0.5)
    metas = {name: AttentionMetadata.build(specs, BLOCK_SIZE, "cpu", None, None, k)
             for name, k in (("kernel", kernel), ("sdpa", None))}
    calls = {name: (lambda m=meta: paged_attention(q, kv, cache, m, attention)) for name, meta in metas.items()}
    return _interleaved(calls, rounds, warmup=3)


def run(args: argparse.Namespace) -> dict:
    kernel = cpu_decode_kernel()
    if kernel is None:
        raise SystemExit("the C++ paged attention kernel did not build here; see the warning above")
    loaded = load_model("bundled", native_gguf=args.native)
    lengths = [args.long_prompt or args.prompt] + [args.prompt] * (max(args.concurrency) - 1)
    needed = sum(_blocks_for(n) for n in lengths)
    runner = ModelRunner(loaded, num_blocks=needed, block_size=BLOCK_SIZE, decode_kernel=kernel)
    # One fixed thread count for both paths: the tuner's trials would otherwise mix counts.
    runner.thread_tuner = ThreadTuner([args.threads])
    rope, join = [layer.plain_rope for layer in runner.model.layers], [layer.plain_join for layer in runner.model.layers]
    calls = [layer.decode_call for layer in runner.model.layers]
    apart, no_calls = [False] * len(rope), [None] * len(rope)
    torch.set_num_threads(args.threads)
    seqs = _prefilled(runner, lengths, seed=0)

    rows = []
    for concurrency in args.concurrency:
        # Each step recomputes every sequence's last position, so the contexts stay put.
        plan = StepPlan([ScheduledChunk(seq=s, start=s.num_computed_tokens, num_tokens=1) for s in seqs[:concurrency]])
        step = _interleaved({"kernel": lambda: _run(runner, plan, kernel, rope, join, calls),
                             "gathered": lambda: _run(runner, plan, None, rope, join, calls),
                             "layer_apart": lambda: _run(runner, plan, kernel, rope, join, no_calls),
                             "separate": lambda: _run(runner, plan, kernel, apart, join, no_calls),
                             "join_apart": lambda: _run(runner, plan, kernel, rope, apart, no_calls)},
                            args.steps, args.warmup)
        alone = _attention_alone(runner, plan, kernel, rounds=5 * args.steps)
        rows.append({"concurrency": concurrency,
                     "kernel_ms": step["kernel"] * 1e3, "gathered_ms": step["gathered"] * 1e3,
                     "ratio": step["gathered"] / step["kernel"], "layer_apart_ms": step["layer_apart"] * 1e3,
                     "layer_ratio": step["layer_apart"] / step["kernel"], "separate_ms": step["separate"] * 1e3,
                     "one_call_ratio": step["separate"] / step["layer_apart"], "join_apart_ms": step["join_apart"] * 1e3,
                     "join_ratio": step["join_apart"] / step["layer_apart"],
                     "attention_kernel_ms": alone["kernel"] * 1e3, "attention_gathered_ms": alone["gathered"] * 1e3,
                     "attention_ratio": alone["gathered"] / alone["kernel"]})
    prefill = []
    for length in args.prefill_lengths:
        alone = _prefill_alone(runner, length, rounds=args.steps)
        flops = 4 * length * length / 2 * runner.config.num_heads * runner.config.head_dim
        prefill.append({"tokens": length, "kernel_ms": alone["kernel"] * 1e3, "sdpa_ms": alone["sdpa"] * 1e3,
                        "ratio": alone["sdpa"] / alone["kernel"], "kernel_gflop_per_s": flops / alone["kernel"] / 1e9,
                        "sdpa_gflop_per_s": flops / alone["sdpa"] / 1e9})
    return {"machine": machine.describe(), "threads": args.threads, "prompt": args.prompt, "native": args.native,
            "long_prompt": args.long_prompt, "steps": args.steps, "rows": rows, "prefill": prefill}


def render(result: dict) -> str:
    long = f" (the first sequence's {result['long_prompt']})" if result.get("long_prompt") else ""
    weights = "quantized weights as served" if result.get("native") else "weights dequantized to float32"
    lines = [f"{result['prompt']}-token contexts{long}, {weights}, {result['threads']} thread(s), A/B interleaved, medians "
             f"({result['steps']} decode steps; {5 * result['steps']} attention calls)",
             f"{'':>11}  {'decode step (ms)':^98}  {'one layer attention (ms)':^36}",
             f"{'concurrency':>11}  {'kernel':>9} {'gathered':>9} {'ratio':>9} {'layer apart':>11} {'layer':>9}"
             f" {'separate':>9} {'one call':>9} {'join apart':>10} {'join':>7}  {'kernel':>9} {'gathered':>9} {'ratio':>15}"]
    for r in result["rows"]:
        lines.append(f"{r['concurrency']:>11}  {r['kernel_ms']:>9.2f} {r['gathered_ms']:>9.2f} {r['ratio']:>8.2f}x"
                     f" {r['layer_apart_ms']:>11.2f} {r['layer_ratio']:>8.2f}x"
                     f" {r['separate_ms']:>9.2f} {r['one_call_ratio']:>8.2f}x {r['join_apart_ms']:>10.2f}"
                     f" {r['join_ratio']:>6.2f}x"
                     f"  {r['attention_kernel_ms']:>9.3f} {r['attention_gathered_ms']:>9.3f} {r['attention_ratio']:>14.2f}x")
    lines.append("ratio = gathered / kernel: above 1, the in-place kernel is faster; layer = layer apart / kernel: "
                 "above 1, a quantized layer's whole decode step as one call (--native) beat its calls apart; "
                 "one call = separate / layer apart: above 1, a layer's RoPE, KV write and attention in one call beat "
                 "them apart; join = join apart / layer apart: above 1, the projections' residual add and norm in "
                 "their own call (quantized weights, --native) beat add_rms_norm_ apart")
    lines += ["", "one layer's causal attention over a whole prompt (ms; GFLOP/s of the causal half)",
              f"{'tokens':>11}  {'kernel':>15} {'sdpa':>15} {'ratio':>9}"]
    for r in result.get("prefill", []):
        lines.append(f"{r['tokens']:>11}  {r['kernel_ms']:>7.3f} ({r['kernel_gflop_per_s']:>4.0f}) "
                     f"{r['sdpa_ms']:>7.3f} ({r['sdpa_gflop_per_s']:>4.0f}) {r['ratio']:>8.2f}x")
    lines.append("ratio = sdpa / kernel: above 1, the prefill kernel is faster")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--long-prompt", type=int, default=None,
                        help="the first sequence's context instead of --prompt")
    parser.add_argument("--prefill-lengths", default="64,250,1000", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--native", action="store_true", help="the file's quantized weights, as the engine serves them")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    counts = args.concurrency + [args.prompt, args.steps, args.threads]
    if min(counts) < 1 or (args.long_prompt is not None and args.long_prompt < 1):
        parser.error("concurrency, prompt, long prompt, steps and threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    report.finish(result, args.json, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
