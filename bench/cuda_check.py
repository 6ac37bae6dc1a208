"""What only a GPU shows, in one short run on a lent machine (the device tool; CI has no GPU).

1. The Triton kernels (batched LoRA, paged decode attention) compiled for the GPU, against float64
   references: the same check scripts the suite runs under TRITON_INTERPRET=1.
2. ModelRunner on CUDA in float32, every tiny test family, against HF transformers' logits.
3. The engine on CUDA serving four adapters and base rows in one batch: peft's greedy tokens (float32),
   and in bfloat16 (CUDA's default dtype) the same first tokens on most rows.
4. GGUF files on CUDA (issue 30: dequantized at load, never failing): float32 tokens equal the CPU's.
5. Decode throughput of a ~360M Llama shape in bfloat16, 32 streams: the engine against HF transformers'
   ``generate`` on the same GPU, the ratio printed.

Two steps: ``prepare DIR`` here (tiny checkpoints, adapters and GGUF files, built with this machine's
transformers and gguf), then ``run DIR --out OUT`` where the GPU is. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("gqa_untied", "mha_tied", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
GGUF_FILES = ("q8_0_tied", "q4_k_m", "every_type")
BLOCK_SIZE = 4


def prepare(folder: Path) -> None:
    from tests.engine.conftest import TINY_CONFIGS, build_tiny_model
    from tests.engine.test_gguf_native import FILES
    from tests.engine.tiny_gguf import write_tiny_gguf
    from tests.lora_pool.test_engine_matches_peft import write_adapters

    folder.mkdir(parents=True, exist_ok=True)
    for kind in FAMILIES:
        assert kind in TINY_CONFIGS, kind
        build_tiny_model(folder / kind, kind)
    base = build_tiny_model(folder / "lora_base", "gqa_untied")
    write_adapters(base, lambda name: folder / "adapters" / name)
    for name in GGUF_FILES:
        types, shape = FILES[name]
        write_tiny_gguf(folder / f"{name}.gguf", types, shape)
    print(f"prepared {folder}")


def triton_kernels(results: dict) -> bool:
    ok = True
    for script, done in (("tests/lora_pool/triton_lora_check.py", "all kernels match"),
                         ("tests/engine/triton_paged_attention_check.py", "all cases match")):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / Path(script).parent), str(REPO), env.get("PYTHONPATH", "")])
        run = subprocess.run([sys.executable, str(REPO / script)], env=env, capture_output=True, text=True, timeout=300)
        passed = run.returncode == 0 and done in run.stdout
        print(run.stdout + run.stderr[-3000:])
        results[script] = {"passed": passed, "lines": run.stdout.splitlines()}
        ok &= passed
    return ok


@torch.no_grad()
def runner_matches_hf(folder: Path, results: dict, device: str) -> bool:
    from transformers import AutoModelForCausalLM

    from engine.attention_kernels import cuda_decode_kernel
    from engine.loader import load_model
    from engine.runner import ModelRunner
    from scheduler.plan import ScheduledChunk, StepPlan
    from scheduler.sequence import Sequence

    ok = True
    for kind in FAMILIES:
        path = folder / kind
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        runner = ModelRunner(load_model(str(path), device, torch.float32), num_blocks=64, block_size=BLOCK_SIZE,
                             device=device, dtype=torch.float32)
        triton = runner.decode_kernel is cuda_decode_kernel() or device == "cpu"
        free = list(range(63, -1, -1))
        gen = torch.Generator().manual_seed(len(kind))
        seqs = [Sequence(f"{kind}-{i}", torch.randint(5, 300, (n,), generator=gen).tolist()) for i, n in enumerate((11, 5, 17))]
        worst = 0.0
        for step in range(5):
            chunks = []
            for seq in seqs:
                start = seq.num_computed_tokens
                n = seq.num_tokens - start if step else min(seq.num_tokens, 8)  # step 0: one prefill in two chunks
                while len(seq.block_table) * BLOCK_SIZE < start + n:
                    seq.block_table.append(free.pop())
                chunks.append(ScheduledChunk(seq=seq, start=start, num_tokens=n))
            plan = StepPlan(chunks)
            logits = runner.execute(plan).float().cpu()
            sampling = [c for c in plan.chunks if c.samples]
            for c, row in zip(sampling, logits):
                expected = reference(torch.tensor([c.seq.all_token_ids[: c.end]])).logits[0, -1].float()
                worst = max(worst, (row - expected).abs().max().item())
            for c in plan.chunks:
                c.seq.num_computed_tokens = c.end
            for c, row in zip(sampling, logits):
                c.seq.output_token_ids.append(int(row.argmax()))
        passed = worst < 1e-3 and triton
        print(f"runner on {device}, {kind}: max abs logit diff vs HF {worst:.2e}, Triton decode kernel {triton}: "
              f"{'ok' if passed else 'MISMATCH'}")
        results[f"runner_{kind}"] = {"max_abs_diff": worst, "triton_decode": triton, "passed": passed}
        ok &= passed
    return ok


def _peft_model(base: Path, adapter: Path | None):
    """The reference for a request on ``adapter`` (None: the base), as test_engine_matches_peft builds it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return (model if adapter is None else PeftModel.from_pretrained(model, adapter)).eval()


def engine_matches_peft(folder: Path, results: dict, device: str) -> bool:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import EngineRequest, SamplingParams
    from tests.lora_pool.test_engine_matches_peft import REQUESTS, peft_greedy, prompts

    base, adapters = folder / "lora_base", folder / "adapters"
    expected = [peft_greedy(_peft_model(base, None if name is None else adapters / name), prompt, 6)[0]
                for (name, _), prompt in zip(REQUESTS, prompts())]
    ok = True
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(model=str(base), device=device, dtype=dtype, max_loras=4, max_cpu_loras=4,
                              max_lora_rank=16, max_num_seqs=8, num_kv_blocks=128, block_size=BLOCK_SIZE)
        with Engine(config) as engine:
            for name in ("attn_r4", "all_r16_rslora", "mlp_r2", "qv_r8_upper_layers"):
                engine.register_adapter(name, str(adapters / name))
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            requests = [EngineRequest(f"{dtype}-{i}", ids, params, adapter=name)
                        for i, ((name, _), ids) in enumerate(zip(REQUESTS, prompts()))]
            got = [ids for _, ids in engine.generate_batch_sync(requests)]
        same = sum(g == e for g, e in zip(got, expected))
        first = sum(g[0] == e[0] for g, e in zip(got, expected))
        # bfloat16 rounds every product: a near tie of the random model may flip a later token.
        passed = same == len(expected) if dtype == "float32" else first >= len(expected) - 1
        print(f"engine on {device}, {dtype}, 4 adapters + base rows in one batch: {same}/{len(expected)} rows equal "
              f"peft's greedy tokens, {first}/{len(expected)} first tokens: {'ok' if passed else 'MISMATCH'}")
        results[f"engine_peft_{dtype}"] = {"rows_equal": same, "first_equal": first, "rows": len(expected),
                                           "passed": passed}
        ok &= passed
    return ok


def gguf_on_cuda(folder: Path, cache: Path, results: dict, device: str) -> bool:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 40, 33], [7, 7, 100, 2, 61, 18], [200]]
    ok = True
    for name in GGUF_FILES:
        path = str(folder / f"{name}.gguf")
        tokens = {}
        for where, dtype in (("cpu", "float32"), (device, "float32"), (device, None)):
            config = EngineConfig(model=path, device=where, dtype=dtype, max_loras=0, num_kv_blocks=64,
                                  block_size=BLOCK_SIZE, cache_dir=str(cache))
            with Engine(config) as engine:
                served = str(engine.runner.model.dtype).removeprefix("torch.")
                requests = [EngineRequest(f"{name}-{i}", ids, params) for i, ids in enumerate(prompts)]
                tokens[(where, served)] = [ids for _, ids in engine.generate_batch_sync(requests)]
        cpu, cuda32 = tokens[("cpu", "float32")], tokens[(device, "float32")]
        default = [key for key in tokens if key != (device, "float32") and key != ("cpu", "float32")]
        passed = cpu == cuda32 and (device == "cpu" or default == [("cuda", "bfloat16")])
        passed = passed and all(len(t) == 8 for key in tokens for t in tokens[key])
        print(f"{name}.gguf on {device}: float32 tokens equal the CPU's {cpu == cuda32}, served by default as "
              f"{default}: {'ok' if passed else 'MISMATCH'}")
        results[f"gguf_{name}"] = {"cuda_float32_equals_cpu": cpu == cuda32, "default": [list(k) for k in default],
                                   "passed": passed}
        ok &= passed
    return ok


def throughput(results: dict, device: str = "cuda", streams: int = 32, prompt_len: int = 128, new_tokens: int = 128,
               num_layers: int = 32) -> None:
    """Decode-heavy batch on a random ~360M Llama (SmolLM2-360M's shape) in bfloat16: engine vs HF generate."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import EngineRequest, SamplingParams

    config = LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=num_layers,
                         num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp()) / "llama-360m"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(_byte_tokenizer()))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(300, 49000, (prompt_len,), generator=gen).tolist() for _ in range(streams)]

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hf_s = {}
    for cache in ("dynamic", "static"):
        with torch.no_grad():
            # A whole run first: the static cache compiles for its length, and its best is the compiled run.
            hf.generate(ids, cache_implementation=cache, **kwargs)
            sync()
            start = time.perf_counter()
            hf.generate(ids, cache_implementation=cache, **kwargs)
            sync()
            hf_s[cache] = time.perf_counter() - start
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()

    engine_config = EngineConfig(model=str(folder), device=device, dtype="bfloat16" if device == "cuda" else "float32", max_loras=0,
                                 max_num_seqs=streams, max_num_batched_tokens=streams * prompt_len,
                                 kv_cache_tokens=streams * (prompt_len + new_tokens + 16))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(engine_config) as engine:
        engine.generate_batch_sync([EngineRequest(f"warm-{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
                                    for i, p in enumerate(prompts)])
        sync()
        start = time.perf_counter()
        out = engine.generate_batch_sync([EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        sync()
        ours_s = time.perf_counter() - start
    assert all(len(ids) == new_tokens for _, ids in out)
    tokens = streams * new_tokens
    best_hf = min(hf_s.values())
    print(f"throughput, ~360M Llama bfloat16, {streams} streams x {prompt_len} prompt + {new_tokens} new tokens: "
          f"tiergate {tokens / ours_s:.0f} tok/s ({ours_s:.2f} s), HF generate dynamic cache "
          f"{tokens / hf_s['dynamic']:.0f} tok/s, static cache {tokens / hf_s['static']:.0f} tok/s; "
          f"ratio to HF's best {best_hf / ours_s:.2f}x")
    results["throughput_360m_bf16"] = {"streams": streams, "prompt_len": prompt_len, "new_tokens": new_tokens,
                                       "tiergate_s": ours_s, "hf_generate_s": hf_s, "ratio_to_hf_best": best_hf / ours_s}


def _byte_tokenizer() -> dict:
    """A WordLevel tokenizer over the model's whole vocabulary: the engine needs one; the bench sends token ids."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(49152)}
    return json.loads(Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")).to_str())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("folder", type=Path)
    run = sub.add_parser("run")
    run.add_argument("folder", type=Path)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--only", help="a comma-separated subset of triton, runner, peft, gguf, throughput")
    run.add_argument("--device", default="cuda", help="cpu: a dry run of checks 2-4 where there is no GPU")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.folder)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run this where there is one (or --device cpu for a dry run)", file=sys.stderr)
        return 1
    import triton

    on_gpu = args.device == "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if on_gpu else platform.processor(),
                     "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    print(json.dumps(results))
    cache = Path(os.environ.get("TMPDIR", "/tmp")) / "cuda-check-cache"
    ok = True
    checks = {"triton": lambda: triton_kernels(results),
              "runner": lambda: runner_matches_hf(args.folder, results, args.device),
              "peft": lambda: engine_matches_peft(args.folder, results, args.device),
              "gguf": lambda: gguf_on_cuda(args.folder, cache, results, args.device)}
    wanted = set(args.only.split(",")) if args.only else set(checks) | {"throughput"}
    if not on_gpu:
        wanted.discard("triton")
    for name, check in checks.items():
        if name not in wanted:
            continue
        try:
            ok &= check()
        except Exception as error:  # one broken check must not hide the others' results
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(repr(error))
            ok = False
    if "throughput" in wanted:
        try:
            throughput(results) if on_gpu else throughput(results, "cpu", streams=4, prompt_len=8, new_tokens=8,
                                                          num_layers=2)
        except Exception as error:
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(repr(error))
            ok = False
    results["passed"] = ok
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_check.json").write_text(json.dumps(results, indent=1))
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
