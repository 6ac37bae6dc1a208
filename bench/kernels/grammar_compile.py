"""Grammar compiles under their budget: what the trial in a worker process adds to a cold compile.

On the bundled SmolLM2-135M's vocabulary: the median time of a cold compile of
a few grammars (a small JSON schema, a 200- and a 1000-item choice list) through
the engine's compiler (a trial in a worker process, then the compile the
request uses; engine/grammar_compiler.py) against xgrammar compiling it once in
this process, as the engine did before the budget; how long a grammar that
would compile for minutes holds the compiler before its refusal; and the
largest per-token grammar work (accept + mask, thread CPU time) of a
length-bounded JSON string (maxLength 10 and 200), what the step budget
(``grammar_mask_budget_s``) must stay above, with the cold compile each bound costs.

    .venv/bin/python -m bench.kernels.grammar_compile [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr

from bench.common import machine, report
from engine.config import default_cache_dir
from engine.grammar import GrammarSpec, compile_spec, tokenizer_info
from engine.grammar_compiler import GrammarCompiler
from engine.grammar_probe import CompileTimeout
from engine.loader import load_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                               "items": {"type": "string"}}},
          "required": ["name", "age"]}


def grammars(round_: int) -> dict[str, GrammarSpec]:
    """Grammars never seen before (the round's tag makes each one new)."""
    tag = f"r{round_}-{time.time_ns()}"
    return {
        "json_schema": GrammarSpec("json_schema", json.dumps({**SCHEMA, "title": tag})),
        "choice_200": GrammarSpec("choice", json.dumps([f"{tag}-{i}-" + "x" * 40 for i in range(200)])),
        "choice_1000": GrammarSpec("choice", json.dumps([f"{tag}-{i}-" + "y" * 50 for i in range(1000)])),
    }


def _step_work_ms(compiler: GrammarCompiler, tokenizer) -> dict[str, dict[str, float]]:
    """Per string length bound: the largest accept + mask CPU time over one answer's tokens, and the cold
    compile (trial and compile, wall time) that the bound's states cost instead."""
    text = '{"name": "Alice Bob", "age": 42}'
    out = {}
    for name, bound in (("maxLength_10", {"maxLength": 10}), ("maxLength_200", {"maxLength": 200}),
                        ("no_length_bound", {})):
        schema = {"type": "object", "properties": {"name": {"type": "string", **bound}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "title": f"{time.time_ns()}"}
        started = time.perf_counter()
        matcher = compiler.matcher(GrammarSpec("json_schema", json.dumps(schema)))
        compile_s = time.perf_counter() - started
        bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        largest = 0.0
        for token in tokenizer.encode(text).ids:
            started = time.thread_time()
            matcher.fill_mask(bitmask, 0)
            largest = max(largest, time.thread_time() - started + matcher.last_accept_s)
            matcher.accept(token)
        out[name] = {"largest_token_work_ms": largest * 1e3, "cold_compile_s": compile_s}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    loaded = load_model("bundled", "cpu", torch.float32, default_cache_dir())
    tokenizer, vocab_size, stop_ids = loaded.tokenizer, loaded.model_config.vocab_size, tuple(loaded.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids, timeout_s=args.budget_s)
    inline = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids), max_threads=1, cache_enabled=False)
    compiler.compile(GrammarSpec("json_object"))  # the worker's start is paid once per server, not per grammar
    times: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for name, spec in grammars(round_).items():
            started = time.perf_counter()
            compile_spec(inline, spec)
            inline_s = time.perf_counter() - started
            started = time.perf_counter()
            compiler.compile(spec)
            budgeted_s = time.perf_counter() - started
            entry = times.setdefault(name, {"inline_s": [], "budgeted_s": []})
            entry["inline_s"].append(inline_s)
            entry["budgeted_s"].append(budgeted_s)
    slow = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "^(a|b){1,2000}c{1,50}$"} for i in range(10)}}))
    started = time.perf_counter()
    try:
        compiler.compile(slow)
    except CompileTimeout:
        pass
    refused_after_s = time.perf_counter() - started
    step_work = _step_work_ms(compiler, tokenizer)
    compiler.close()
    result = {"machine": machine.describe(), "budget_s": args.budget_s,
              "cold_compile_median_s": {name: {k: statistics.median(v) for k, v in entry.items()}
                                        for name, entry in times.items()},
              "slow_grammar_refused_after_s": refused_after_s, "token_work_by_length_bound": step_work}
    report.finish(result, args.json)


if __name__ == "__main__":
    main()
