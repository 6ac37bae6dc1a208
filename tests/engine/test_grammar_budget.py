"""Issue #31's grammar costs in the engine: no compile on a caller's thread or the engine's, a cache per
tenant whose byte bound holds, a compile killed at its budget, and a grammar too slow for its step budget
ending its own request alone.

The model is the tiny random Llama with the 256-byte tokenizer (conftest's ``make_byte_engine``).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

import engine.grammar_compiler as grammar_compiler
from engine.engine import Engine
from engine.grammar import GrammarSpec
from engine.grammar_cache import GrammarCache
from engine.grammar_compiler import GrammarCompiler
from engine import grammar_probe
from engine.grammar_probe import CompileStarved, CompileTimeout
from engine.loader import byte_tokenizer
from engine.request import MASK_OVER_BUDGET, EngineRequest, SamplingParams

SMALL = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False}))
# Each step's work of this grammar grows with its output (accepting a token re-parses an ambiguous
# derivation): issue #31's defect 7.
AMBIGUOUS = GrammarSpec("ebnf", 'root ::= y{2000} "z"\ny ::= x "a"\nx ::= x x | "a" | ""')


def slow_schema(tag: str) -> GrammarSpec:
    """A small schema (under a kilobyte) whose compile takes far longer than a few seconds: long counted
    repetitions inside string patterns, one per property."""
    props = {f"{tag}{i}": {"type": "string", "pattern": "^(a|b){1,2000}c{1,50}$"} for i in range(10)}
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)}))


def choices(tag: str, n: int = 40) -> GrammarSpec:
    return GrammarSpec("choice", json.dumps([f"{tag}-{i}-" + "x" * 40 for i in range(n)]))


@pytest.fixture
def compiles_seen(monkeypatch) -> list[str]:
    """The thread of every compile run in the server process."""
    seen: list[str] = []
    compile_spec = grammar_compiler.compile_spec

    def counted(compiler, spec):
        seen.append(threading.current_thread().name)
        return compile_spec(compiler, spec)

    monkeypatch.setattr(grammar_compiler, "compile_spec", counted)
    return seen


def _run(engine: Engine, requests: list[EngineRequest]) -> list[list]:
    """Every request's deltas, submitted from an event loop (as the gateway does) and run together."""

    async def one(request: EngineRequest) -> list:
        return [d async for d in engine.generate(request)]

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def test_submit_with_the_gateways_compiled_grammar_never_compiles_even_after_the_cache_dropped_it(
        make_byte_engine, compiles_seen):
    engine, _ = make_byte_engine()
    compiled = engine.grammars.compile(SMALL, "acme")
    assert len(compiles_seen) == 1
    engine.grammars.cache.clear()  # evicted between the gateway's compile and the engine's admission
    request = EngineRequest("r", [1, 2], SamplingParams(max_tokens=30, temperature=0.0, grammar=SMALL),
                            tenant="acme", compiled_grammar=compiled)
    [deltas] = _run(engine, [request])
    assert json.loads("".join(d.text for d in deltas)) in ({"ok": True}, {"ok": False})
    assert len(compiles_seen) == 1


def test_submit_without_a_compiled_grammar_compiles_on_the_compilers_own_threads(make_byte_engine,
                                                                                 compiles_seen):
    engine, _ = make_byte_engine()
    request = EngineRequest("r", [1, 2], SamplingParams(max_tokens=30, temperature=0.0, grammar=SMALL))
    [deltas] = _run(engine, [request])
    assert deltas[-1].error is None
    assert len(compiles_seen) == 1 and compiles_seen[0].startswith("grammar-compile")


def _scheduling_policy(pid: int) -> int:
    """The scheduling policy of a thread or process, from /proc (field 41 of its stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[38])


def test_a_compile_and_its_trial_run_only_on_cpu_the_engine_leaves_idle(monkeypatch):
    policies: list[int] = []
    compile_spec = grammar_compiler.compile_spec

    def seen(compiler, spec):
        policies.append(os.sched_getscheduler(threading.get_native_id()))
        return compile_spec(compiler, spec)

    monkeypatch.setattr(grammar_compiler, "compile_spec", seen)
    ours = os.sched_getscheduler(threading.get_native_id())
    compiler = GrammarCompiler(byte_tokenizer(), 256, ())
    try:
        compiler.compile(SMALL)
        trial_workers = [w._process.pid for w in compiler._probes._all if w._process is not None]
        assert trial_workers and all(_scheduling_policy(pid) == os.SCHED_IDLE for pid in trial_workers)
    finally:
        compiler.close()
    assert policies == [os.SCHED_IDLE]
    assert os.sched_getscheduler(threading.get_native_id()) == ours  # the caller's is as it was


def test_a_trial_starved_of_cpu_is_stopped_as_the_servers_fault_and_not_cached(monkeypatch):
    # A wall-time limit far below the grammar's CPU time stands in for a machine too busy to run the trial.
    monkeypatch.setattr(grammar_probe, "STARVED_AFTER", 0.1)
    compiler = GrammarCompiler(byte_tokenizer(), 256, (), timeout_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(CompileStarved) as stopped:
            compiler.compile(slow_schema("s"))
        assert time.monotonic() - started < 5.0  # stopped at the wall limit, not at the CPU budget
        assert 0 < stopped.value.cpu_s <= 1.0
        assert len(compiler.cache) == 0
        assert compiler.compile(SMALL) is not None  # the stopped worker is replaced
    finally:
        compiler.close()


def test_the_cache_is_per_tenant_unless_shared_by_opt_in(make_byte_engine, compiles_seen):
    engine, _ = make_byte_engine()
    engine.grammars.compile(choices("a"), "tenant-a")
    engine.grammars.compile(choices("a"), "tenant-a")
    assert len(compiles_seen) == 1  # a's own entry
    assert engine.grammars.cached(choices("a"), "tenant-b") is None
    engine.grammars.compile(choices("a"), "tenant-b")
    assert len(compiles_seen) == 2  # b never hits a's entry: no timing tells b what a compiled

    shared, _ = make_byte_engine(grammar_cache_scope="shared")
    shared.grammars.compile(choices("a"), "tenant-a")
    shared.grammars.compile(choices("a"), "tenant-b")
    assert len(compiles_seen) == 3


def test_the_cache_stays_within_its_bound_in_bytes_after_many_distinct_grammars():
    compiler = GrammarCompiler(byte_tokenizer(), 256, (), cache_bytes=400_000)
    try:
        sizes = [compiler.submit(choices(f"g{i}", 200), "acme").result().grammar.memory_size_bytes
                 for i in range(30)]
        assert sum(sizes) > 3 * compiler.cache.limit_bytes  # the bound had to evict
        assert 0 < compiler.cache.size_bytes <= compiler.cache.limit_bytes
        assert 0 < len(compiler.cache) < 30
        assert compiler.cached(choices("g29", 200), "acme") is not None  # least recently used went first
        assert compiler.cached(choices("g0", 200), "acme") is None
    finally:
        compiler.close()


def test_a_grammar_larger_than_the_whole_cache_is_served_but_not_kept():
    cache = GrammarCache(limit_bytes=1000)
    compiler = GrammarCompiler(byte_tokenizer(), 256, ())
    try:
        compiled = compiler.compile(choices("big", 200))
        cache.put("acme", choices("big", 200), compiled)
        assert len(cache) == 0 and cache.size_bytes == 0
    finally:
        compiler.close()


def test_a_compile_over_its_cpu_budget_is_killed_and_billed_for_its_time():
    compiler = GrammarCompiler(byte_tokenizer(), 256, (), timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(CompileTimeout, match="longer than the budget of 1 s") as refused:
            compiler.compile(slow_schema("p"))
        assert time.monotonic() - started < grammar_probe.STARVED_AFTER * 1.0  # the CPU budget ended it
        assert refused.value.cpu_s >= 1.0
        assert len(compiler.cache) == 0
        # The killed worker is replaced: the next grammar compiles.
        assert compiler.compile(SMALL) is not None
    finally:
        compiler.close()


def test_a_grammar_over_its_step_budget_ends_its_request_alone(make_byte_engine):
    engine, events = make_byte_engine(grammar_mask_budget_s=0.002)
    ambiguous = EngineRequest("ambiguous", [1, 2], SamplingParams(max_tokens=400, temperature=0.0,
                                                                  grammar=AMBIGUOUS))
    neighbour = EngineRequest("neighbour", [3, 4], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    slow, plain = _run(engine, [ambiguous, neighbour])
    assert plain[-1].error is None and plain[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in plain) == 40
    assert slow[-1].error == MASK_OVER_BUDGET
    made = sum(len(d.token_ids) for d in slow)
    assert 40 < made < 400  # it ran beside the neighbour, and ended long before its grammar or max_tokens
    assert set("".join(d.text for d in slow)) == {"a"}
    finish = [e for e in events if getattr(e, "request_id", None) == "ambiguous" and hasattr(e, "status")]
    assert finish and finish[-1].status == "error" and finish[-1].completion_tokens == made
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0
