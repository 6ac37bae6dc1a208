"""Structured outputs: what a JSON schema costs the engine.

On the bundled SmolLM2-135M: output tokens/s of N concurrent requests all under
one JSON schema against the same work free, the time the engine spent masking
logits in those steps, the mask of one step of N rows through xgrammar's CPU
kernel and through ours, grammar compile time cold (a schema never seen) and
cached, and N/4 requests with n=4 against N separate requests. The
unconstrained engine is the peer: the goal is constrained >= 0.9 of it.

Like with like: each free request is given exactly as many tokens as its
schema twin generated (EOS ignored), so both runs make the same tokens in the
same batch shapes. The runs alternate in pairs in one process (schema, free,
n=4, separate, then again), and the headline ratio is the median over rounds of
each pair's ratio, so load that drifts on a shared machine hits both halves of
a pair alike; tokens per engine-busy second (the sum of step times) and per
CPU-second are reported beside wall-clock tokens/s.

    .venv/bin/python -m bench.offline.structured [--concurrency 32] [--max-tokens 32] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr

import engine.step_loop as engine_module
from bench.common import machine, report
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
WARMUP_BATCHES = 8
# A whole answer to SCHEMA, for matchers at several points of one.
ANSWER = {"title": "The Long Goodbye", "year": 1973, "tags": ["noir", "crime", "Los Angeles"],
          "reviews": [{"author": "Ann", "stars": 5, "text": "Moody, funny and sad; Gould is perfect."},
                      {"author": "Bo", "stars": 3, "text": "Slow in the middle."}]}
PROMPT = "Describe a film you like as JSON with its title, year, tags and a few reviews."


class MaskTimer:
    """Wraps the engine's mask step to time it (the bench's only hook into the engine)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, logits: torch.Tensor, matchers: list, budget_s: float | None = None) -> list[int]:
        """As ``engine.grammar.mask_logits``, whose place it takes in the step loop."""
        started = time.perf_counter()
        over_budget = mask_logits(logits, matchers, budget_s)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return over_budget


def _prompt(engine: Engine, tag: str) -> list[int]:
    # A tag per run keeps one run's prompt blocks out of the next run's prefix-cache hits.
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": f"[{tag}] {PROMPT}"}])


def _requests(engine: Engine, count: int, max_tokens: int | list[int], grammar: GrammarSpec | None, tag: str,
              n: int = 1, distinct_prompts: int = 1) -> list[EngineRequest]:
    """``max_tokens`` a number, or one per request (a free twin's, from its schema run)."""
    prompts = [_prompt(engine, f"{tag}-{p}") for p in range(distinct_prompts)]
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * count
    return [EngineRequest(f"{tag}-{i}", prompts[i % distinct_prompts], SamplingParams(
                max_tokens=limits[i], temperature=0.7, seed=i, ignore_eos=grammar is None, grammar=grammar, n=n))
            for i in range(count)]


def _throughput(engine: Engine, requests: list[EngineRequest], mask_timer: MaskTimer) -> dict:
    computed, busy = [], []
    def on_event(event) -> None:
        if isinstance(event, StepEvent):
            computed.append(sum(item.tokens for item in event.items))
            busy.append(event.duration_s)

    engine.add_listener(on_event)
    mask_timer.seconds, mask_timer.calls = 0.0, 0
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    outputs = engine.generate_batch_sync(requests)
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_before
    engine.remove_listener(on_event)
    tokens = sum(len(ids) for _, ids in outputs)
    params = requests[0].params
    valid = None
    if params.grammar is not None:
        valid = sum(_parses(text) for text, ids in outputs if len(ids) < params.max_tokens)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "cpu_s": cpu, "tok_per_cpu_s": tokens / cpu,
            "busy_s": sum(busy), "tok_per_busy_s": tokens / sum(busy),
            "complete_and_valid": valid, "lengths": [len(ids) for _, ids in outputs],
            "tokens_computed": sum(computed), "steps": len(computed),
            "mask_ms_per_step": mask_timer.seconds * 1e3 / max(1, mask_timer.calls),
            "mask_share": mask_timer.seconds / sum(busy)}


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


def _mask_ms(engine: Engine, rows: int, repeats: int = 30) -> dict:
    """Median ms of one step's mask for ``rows`` rows under SCHEMA, each row at another point of an answer:
    filling the bitmask, applying a filled one through xgrammar's CPU kernel, and mask_logits (fill and apply)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    answer = engine.tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    matchers = []
    for row in range(rows):
        matcher = engine.grammars.matcher(spec)
        assert all(matcher.accept(t) for t in answer[: row * len(answer) // rows])
        matchers.append(matcher)
    vocab = engine.model_config.vocab_size
    bitmask = xgr.allocate_token_bitmask(rows, vocab)

    def fill(_logits: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_mask(bitmask, row)

    ways = {"fill": fill, "xgrammar_apply": lambda logits: xgr.apply_token_bitmask_inplace(logits, bitmask),
            "mask_logits": lambda logits: mask_logits(logits, matchers)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):  # interleaved, so load that drifts hits all alike
        for name, way in ways.items():
            logits = torch.randn(rows, vocab)  # fresh, as each step's are
            started = time.perf_counter()
            way(logits)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


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
        mask_ms = _mask_ms(engine, concurrency)
        # The engine times each step size on 1 and on more threads over its first steps of that size
        # (engine/cpu_threads.py); warm-up batches of the measured shape take those trials, one prefill
        # step each, so that no measured run pays for them and both halves of a pair run on one choice.
        for w in range(WARMUP_BATCHES):
            engine.generate_batch_sync(_requests(engine, concurrency, 8, spec if w % 2 else None, f"w{w}",
                                                 distinct_prompts=concurrency))
        groups = concurrency // 4
        runs: dict[str, list[dict]] = {name: [] for name in ("json_schema", "free", "n=4", "4 separate")}
        for r in range(rounds):
            schema = _throughput(engine, _requests(engine, concurrency, max_tokens, spec, f"j{r}",
                                                   distinct_prompts=concurrency), mask_timer)
            runs["json_schema"].append(schema)
            # Each free twin makes exactly the tokens its schema request made.
            runs["free"].append(_throughput(engine, _requests(engine, concurrency, schema["lengths"], None, f"f{r}",
                                                              distinct_prompts=concurrency), mask_timer))
            runs["n=4"].append(_throughput(engine, _requests(engine, groups, max_tokens, None, f"n{r}", n=4,
                                                             distinct_prompts=groups), mask_timer))
            runs["4 separate"].append(_throughput(engine, _requests(engine, concurrency, max_tokens, None, f"s{r}",
                                                                    distinct_prompts=groups), mask_timer))
        ratios = {f"{prefix}{key}": _paired(runs, a, b, metric)
                  for prefix, a, b in (("", "json_schema", "free"), ("n_", "n=4", "4 separate"))
                  for key, metric in (("ratio", "tok_s"), ("busy_ratio", "tok_per_busy_s"),
                                      ("cpu_ratio", "tok_per_cpu_s"))}
        return {
            "machine": host,
            "settings": {"model": engine.model_name, "concurrency": concurrency, "max_tokens": max_tokens,
                         "rounds": rounds, "vocab_size": engine.model_config.vocab_size},
            "engine_load_s": engine_load_s,
            "compile": compile_times,
            "mask_ms": mask_ms,
            "runs": runs,
            **ratios,
        }
    finally:
        engine_module.mask_logits = mask_logits
        engine.shutdown()


def _paired(runs: dict[str, list[dict]], a: str, b: str, metric: str) -> float:
    """The median over rounds of run ``a``'s metric over run ``b``'s in the same round."""
    return statistics.median(x[metric] / y[metric] for x, y in zip(runs[a], runs[b]))


def render_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        report.measured(result),
        "",
        f"{s['model']} (vocab {s['vocab_size']}), {s['concurrency']} concurrent requests of up to "
        f"{s['max_tokens']} tokens, temperature 0.7, a prompt each; schema runs end where the JSON closes or at "
        "the limit, and each free request then makes exactly as many tokens as its schema twin (EOS ignored); "
        f"n=4 runs {s['concurrency'] // 4} requests of 4 choices against {s['concurrency']} separate "
        f"requests (4 per prompt, prefix cache on for both); {s['rounds']} rounds, each running schema, free, n=4 "
        "and separate in turn; a ratio is the median over rounds of its pair's ratio in the round.",
        "",
        "| run | round | output tokens | tokens computed | steps | wall (s) | output tok/s | engine busy (s) "
        "| output tok per busy-s | CPU (s) | output tok per CPU-s | mask ms/step | mask share of busy "
        "| finished JSON that parses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, runs in result["runs"].items():
        for i, r in enumerate(runs):
            valid = "-" if r["complete_and_valid"] is None else str(r["complete_and_valid"])
            lines.append(f"| {kind} | {i} | {r['tokens']} | {r['tokens_computed']} | {r['steps']} | "
                         f"{r['wall_s']:.2f} | {r['tok_s']:.1f} | {r['busy_s']:.2f} | {r['tok_per_busy_s']:.1f} | "
                         f"{r['cpu_s']:.1f} | {r['tok_per_cpu_s']:.1f} | {r['mask_ms_per_step']:.2f} | "
                         f"{r['mask_share']:.1%} | {valid} |")
    c, m = result["compile"], result["mask_ms"]
    lines += [
        "",
        f"**Constrained / free: {result['ratio']:.2f}x output tokens/s, {result['busy_ratio']:.2f}x per "
        f"engine-busy second, {result['cpu_ratio']:.2f}x per CPU-second** (goal >= 0.9).  ",
        f"**n=4 / four separate requests: {result['n_ratio']:.2f}x output tokens/s, {result['n_busy_ratio']:.2f}x "
        f"per engine-busy second, {result['n_cpu_ratio']:.2f}x per CPU-second.**  ",
        f"Mask of one step of {s['concurrency']} rows (median of 30, interleaved): filling the bitmask "
        f"{m['fill']:.2f} ms; applying it through xgrammar's CPU kernel {m['xgrammar_apply']:.2f} ms; "
        f"mask_logits, fill and apply, {m['mask_logits']:.2f} ms.  ",
        f"Grammar compile of the schema: cold {c['cold_ms_median']:.1f} ms, cached {c['cached_ms_median']:.3f} ms "
        "(median of 5).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offline.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args.concurrency, args.max_tokens, args.rounds)
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
