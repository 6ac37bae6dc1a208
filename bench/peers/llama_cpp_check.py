"""llama.cpp's own decode-step time for a batch of B sequences, as its `llama-batched-bench` measures it.

B sequences of P prompt tokens each are prefilled, then every step is one
`llama_decode` of B tokens (one per sequence, each wanting logits); the step
time is taken both around the call and from llama.cpp's own counters
(`llama_perf_context`: t_eval_ms over n_eval). This is the reference the
throughput runner's step times are checked against (bench/RESULTS.md), and it
measures the context settings the runner chose: the order the sequences' tokens
reach `llama_decode`, `kv_unified` and flash attention.

    .venv/bin/python -m bench.peers.llama_cpp_check [--batch 1,8,32] [--prompt 250] [--steps 16]
        [--threads N] [--variants runner,descending,unified,no-flash,flash]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import llama_cpp

from bench.common import model_files
from bench.peers.llama_cpp_runner import BATCH_TOKENS, context_params

# name -> (context settings over the runner's, sequence order within a step)
VARIANTS = {
    "runner": ({}, "ascending"),
    "descending": ({}, "descending"),
    "unified": ({"kv_unified": True}, "ascending"),
    "no-flash": ({"flash_attn_type": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}, "ascending"),
    "flash": ({"flash_attn_type": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED}, "ascending"),
}


@dataclass
class StepTiming:
    variant: str
    batch: int
    wall_ms: float  # median over the steps, around llama_decode
    llama_ms: float  # llama.cpp's own eval time per decode call, mean


def _fill(batch, tokens: list[tuple[int, int, int, bool]]) -> None:
    for i, (token, pos, seq_id, logits) in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq_id, logits
    batch.n_tokens = len(tokens)


def measure(model, variant: str, batch_size: int, prompt_len: int, steps: int, threads: int) -> StepTiming:
    overrides, order = VARIANTS[variant]
    params = context_params(batch_size, prompt_len + steps + 1, threads)
    for key, value in overrides.items():
        setattr(params, key, value)
    params.no_perf = False
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
    try:
        for seq in range(batch_size):
            prompt = [(100 + (seq * 31 + i) % 20000, i, seq, i == prompt_len - 1) for i in range(prompt_len)]
            for start in range(0, prompt_len, BATCH_TOKENS):
                _fill(batch, prompt[start:start + BATCH_TOKENS])
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed in prefill")
        seqs = list(range(batch_size))
        if order == "descending":
            seqs.reverse()
        walls = []
        llama_cpp.llama_perf_context_reset(ctx)
        for step in range(steps):
            _fill(batch, [(200 + step, prompt_len + step, seq, True) for seq in seqs])
            started = time.perf_counter()
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            llama_cpp.llama_synchronize(ctx)  # where llama.cpp books the call's time
            walls.append(time.perf_counter() - started)
        perf = llama_cpp.llama_perf_context(ctx)
        # llama.cpp books a call of more than one token as prompt eval, of one token as eval.
        return StepTiming(variant, batch_size, statistics.median(walls) * 1e3, (perf.t_eval_ms + perf.t_p_eval_ms) / steps)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.llama_cpp_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--prompt", type=int, default=250)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--variants", default="runner,descending,unified,no-flash")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the variants, interleaved")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(model_files.f32_gguf()).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError("llama.cpp could not load the F32 GGUF")
    print(f"llama.cpp decode step, F32, prompt {args.prompt} tokens per sequence, {args.threads} threads, "
          f"median of {args.steps} steps; {llama_cpp.llama_print_system_info().decode().strip()}")
    print("| variant | batch | wall ms/step | llama.cpp t_eval ms/step | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    try:
        for _ in range(args.repeat):
            for b in (int(x) for x in args.batch.split(",")):
                for variant in variants:
                    t = measure(model, variant, b, args.prompt, args.steps, args.threads)
                    print(f"| {t.variant} | {t.batch} | {t.wall_ms:.1f} | {t.llama_ms:.1f} | {b / t.wall_ms * 1e3:.0f} |",
                          flush=True)
    finally:
        llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
