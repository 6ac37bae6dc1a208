"""Structured outputs: what a JSON schema costs the engine.

On the bundled SmolLM2-135M: output tokens/s of N concurrent requests all under
one JSON schema against the same requests free (runs interleaved A/B/A/B in
one process, best of each kept), the time the engine spent masking logits in
those steps, grammar compile time cold (a schema never seen) and cached, and
N/4 requests with n=4 against N separate requests. The unconstrained engine is
the peer: the goal is constrained >= 0.9 of it.

    .venv/bin/python -m bench.structured [--concurrency 32] [--max-tokens 32] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import engine.step_loop as engine_module
from bench import machine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import StepEvent
from engine.grammar import GrammarSpec, mask_logits
from engine.request import EngineRequest, SamplingParams

# Long enough that a model rarely closes it before max_tokens, so both runs make about the same tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "reviews": {"type": "array", "items": {
            "type": "object",
            "properties": {"author": {"type": "string"}, "stars": {"type": "integer"}, "text": {"type": "string"}},
            "required": ["author", "stars", "text"]}},
    },
    "required": ["title", "year", "tags", "reviews"],
}  # fmt: skip
PROMPT = "Describe a film you like as JSON with its title, year, tags and a few reviews."


class MaskTimer:
    """Wraps the engine's mask step to time it (the bench's only hook into the engine)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, logits, matchers) -> None:
        started = time.perf_counter()
        mask_logits(logits, matchers)
        self.seconds += time.perf_counter() - started
        self.calls += 1


def _prompt(engine: Engine, tag: str) -> list[int]:
    # A tag per run keeps one run's prompt blocks out of the next run's prefix-cache hits.
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": f"[{tag}] {PROMPT}"}])


def _requests(engine: Engine, count: int, max_tokens: int, grammar: GrammarSpec | None, tag: str,
              n: int = 1, distinct_prompts: int = 1) -> list[EngineRequest]:
    prompts = [_prompt(engine, f"{tag}-{p}") for p in range(distinct_prompts)]
    return [EngineRequest(f"{tag}-{i}", prompts[i % distinct_prompts], SamplingParams(
                max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=grammar is None, grammar=grammar, n=n))
            for i in range(count)]


def _throughput(engine: Engine, requests: list[EngineRequest], mask_timer: MaskTimer) -> dict:
    computed = []
    engine.add_listener(lambda e: computed.append(sum(it.tokens for it in e.items)) if isinstance(e, StepEvent)
                        else None)
    mask_timer.seconds, mask_timer.calls = 0.0, 0
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    outputs = engine.generate_batch_sync(requests)
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_before
    engine._listeners.pop()
    tokens = sum(len(ids) for _, ids in outputs)
    params = requests[0].params
    valid = None
    if params.grammar is not None:
        valid = sum(_parses(text) for text, ids in outputs if len(ids) < params.max_tokens)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "cpu_s": cpu, "tok_per_cpu_s": tokens / cpu,
            "complete_and_valid": valid,
            "tokens_computed": sum(computed), "steps": len(computed),
            "mask_ms_per_step": mask_timer.seconds * 1e3 / max(1, mask_timer.calls)}


def _cpu_seconds() -> float:
    # On a machine shared with other jobs, wall time swings with their load; the CPU time this
    # process spent per token does much less, so both are reported.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _compile_ms(engine: Engine, repeats: int = 5) -> dict:
    cold, cached = [], []
    for i in range(repeats):
        schema = dict(SCHEMA, properties={**SCHEMA["properties"], f"extra_{i}_{time.time_ns()}": {"type": "string"}})
        spec = GrammarSpec("json_schema", json.dumps(schema))
        started = time.perf_counter()
        engine.grammars.compile(spec)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.grammars.compile(spec)
        cached.append(time.perf_counter() - started)
    return {"cold_ms_median": statistics.median(cold) * 1e3, "cached_ms_median": statistics.median(cached) * 1e3}


def run(concurrency: int, max_tokens: int, rounds: int) -> dict:
    host = machine.describe()
    started = time.perf_counter()
    engine = Engine(EngineConfig(model="bundled", max_num_seqs=max(32, concurrency), max_loras=0)).start()
    engine_load_s = time.perf_counter() - started
    mask_timer = MaskTimer()
    engine_module.mask_logits = mask_timer
    try:
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        compile_times = _compile_ms(engine)
        engine.generate_batch_sync(_requests(engine, 2, 8, None, "warmup"))
        groups = concurrency // 4
        batches = {
            "free": lambda r: _requests(engine, concurrency, max_tokens, None, f"f{r}", distinct_prompts=concurrency),
            "json_schema": lambda r: _requests(engine, concurrency, max_tokens, spec, f"j{r}",
                                               distinct_prompts=concurrency),
            "n=4": lambda r: _requests(engine, groups, max_tokens, None, f"n{r}", n=4, distinct_prompts=groups),
            "4 separate": lambda r: _requests(engine, concurrency, max_tokens, None, f"s{r}",
                                              distinct_prompts=groups),
        }
        runs: dict[str, list[dict]] = {name: [] for name in batches}
        for r in range(rounds):  # interleaved, so drifting load on a shared machine hits all alike
            for name, make in batches.items():
                runs[name].append(_throughput(engine, make(r), mask_timer))
        best = {k: max(v, key=lambda x: x["tok_s"]) for k, v in runs.items()}
        return {
            "machine": host,
            "settings": {"model": engine.model_name, "concurrency": concurrency, "max_tokens": max_tokens,
                         "rounds": rounds, "vocab_size": engine.model_config.vocab_size},
            "engine_load_s": engine_load_s,
            "compile": compile_times,
            "runs": runs,
            "ratio": best["json_schema"]["tok_s"] / best["free"]["tok_s"],
            "n_ratio": best["n=4"]["tok_s"] / best["4 separate"]["tok_s"],
            "cpu_ratio": _best_cpu(runs, "json_schema") / _best_cpu(runs, "free"),
            "n_cpu_ratio": _best_cpu(runs, "n=4") / _best_cpu(runs, "4 separate"),
        }
    finally:
        engine_module.mask_logits = mask_logits
        engine.shutdown()


def _best_cpu(runs: dict[str, list[dict]], name: str) -> float:
    return max(r["tok_per_cpu_s"] for r in runs[name])


def render_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Measured {machine.render_markdown(result['machine'])}.",
        "",
        f"{s['model']} (vocab {s['vocab_size']}), {s['concurrency']} concurrent requests of up to "
        f"{s['max_tokens']} tokens, temperature 0.7, a prompt each; free runs ignore EOS, schema runs end where "
        f"the JSON closes; n=4 runs {s['concurrency'] // 4} requests of 4 choices against {s['concurrency']} separate "
        f"requests (4 per prompt, prefix cache on for both); {s['rounds']} interleaved rounds, best of each.",
        "",
        "| run | round | output tokens | tokens computed | steps | wall (s) | output tok/s | CPU (s) "
        "| output tok per CPU-s | mask ms/step | finished JSON that parses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, runs in result["runs"].items():
        for i, r in enumerate(runs):
            valid = "-" if r["complete_and_valid"] is None else str(r["complete_and_valid"])
            lines.append(f"| {kind} | {i} | {r['tokens']} | {r['tokens_computed']} | {r['steps']} | "
                         f"{r['wall_s']:.2f} | {r['tok_s']:.1f} | {r['cpu_s']:.1f} | {r['tok_per_cpu_s']:.1f} | "
                         f"{r['mask_ms_per_step']:.2f} | {valid} |")
    c = result["compile"]
    lines += [
        "",
        f"**Constrained / free: {result['ratio']:.2f}x output tokens/s, {result['cpu_ratio']:.2f}x output tokens "
        "per CPU-second** (goal >= 0.9).  ",
        f"**n=4 / four separate requests: {result['n_ratio']:.2f}x output tokens/s, {result['n_cpu_ratio']:.2f}x "
        "per CPU-second.**  ",
        f"Grammar compile of the schema: cold {c['cold_ms_median']:.1f} ms, cached {c['cached_ms_median']:.3f} ms "
        "(median of 5).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args.concurrency, args.max_tokens, args.rounds)
    print(render_markdown(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
