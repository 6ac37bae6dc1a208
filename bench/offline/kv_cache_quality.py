"""What the 8-bit KV cache costs in logprobs (issue 30): tiergate's Q8_0 pool and llama.cpp's Q8_0 cache,
each against the same engine with a float32 cache, teacher-forced over real English text.

The bundled Q4_1 file, ``--tokens`` tokens of bench/data/passages.txt. Both engines take the text in
chunks of ``--chunk`` tokens (tiergate's ``max_num_batched_tokens``, llama.cpp's n_batch and n_ubatch),
so each position attends to a context read back from the cache: tiergate's chunks attend to their own
keys as computed and to earlier chunks' as stored; llama.cpp stores a ubatch's keys before it attends.
Reported per engine and format: mean and max |Δ logprob| of each next token against the float32
cache, and how often the likeliest token is the same. llama.cpp's F16 cache (its default) is shown too; llama.cpp
runs with flash attention in all three (its quantized V cache needs it).

    .venv/bin/python -m bench.offline.kv_cache_quality [--tokens 600] [--chunk 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import torch

from bench.common import machine, model_files, paths, report

TEXT = paths.ROOT / "bench" / "data" / "passages.txt"


def tiergate_scores(ids: list[int], kv_cache_dtype: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each next token, the likeliest token at each position) for ids[1:], via prompt logprobs."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import EngineRequest, SamplingParams

    engine = Engine(EngineConfig(model="bundled", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=chunk,
                                 max_num_seqs=1, max_loras=0, kv_cache_tokens=4096)).start()

    async def run():
        request = EngineRequest("scored", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        return [d async for d in engine.generate(request)]

    try:
        deltas = asyncio.run(run())
    finally:
        engine.shutdown()
    scores = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)[1:]
    return torch.tensor([s.logprob for s in scores]), torch.tensor([s.top[0][0] for s in scores])


def llama_cpp_scores(ids: list[int], kv_type: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    import llama_cpp
    from llama_cpp import Llama

    types = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    threads = os.cpu_count() or 1
    model = Llama(model_path=str(model_files.bundled_gguf()), n_ctx=len(ids) + 64, n_batch=chunk, n_ubatch=chunk,
                  n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False,
                  type_k=types[kv_type], type_v=types[kv_type], flash_attn=True)
    try:
        model.eval(ids)
        logprobs = torch.log_softmax(torch.tensor(model.scores[: len(ids) - 1]), dim=-1)
    finally:
        model.close()
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1), logprobs.argmax(-1)


def compare(reference: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> dict:
    delta = (other[0] - reference[0]).abs()
    return {"mean_abs_dlogprob": delta.mean().item(), "max_abs_dlogprob": delta.max().item(),
            "top1_agreement": (other[1] == reference[1]).float().mean().item(), "tokens": len(delta)}


def render_markdown(result: dict) -> str:
    lines = [machine.render_markdown(result["machine"]),
             f"bundled Q4_1, {result['tokens']} tokens of passages.txt in chunks of {result['settings']['chunk']}, "
             "each against its own engine with a float32 KV cache:"]
    for name, r in result["against_float32"].items():
        lines.append(f"  {name}: mean |dlogprob| {r['mean_abs_dlogprob']:.4f}, max {r['max_abs_dlogprob']:.4f}, "
                     f"top-1 agreement {r['top1_agreement']:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offline.kv_cache_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.chunk < 1:
        p.error("--tokens must be at least 2 and --chunk positive")
    from engine.loader import load_model

    tokenizer = load_model("bundled").tokenizer
    ids = tokenizer.encode(TEXT.read_text()).ids[: args.tokens]
    result = {"machine": machine.describe(), "settings": vars(args), "tokens": len(ids), "against_float32": {}}
    ours = {fmt: tiergate_scores(ids, fmt, args.chunk) for fmt in ("auto", "q8_0")}
    result["against_float32"]["tiergate q8_0"] = compare(ours["auto"], ours["q8_0"])
    if not args.no_llama_cpp:
        theirs = {fmt: llama_cpp_scores(ids, fmt, args.chunk) for fmt in ("f32", "f16", "q8_0")}
        result["against_float32"]["llama.cpp q8_0"] = compare(theirs["f32"], theirs["q8_0"])
        result["against_float32"]["llama.cpp f16"] = compare(theirs["f32"], theirs["f16"])
    print(render_markdown(result))
    if args.json:
        report.write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
