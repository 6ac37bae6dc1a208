"""Compiling a request's grammar within a time budget, off every loop, cached per tenant.

A compile runs on this compiler's own threads (never the caller's, never the
engine thread, never the thread pool that serves the gateway's other off-loop
work), on CPU the engine leaves idle: a trial in a worker process that is
killed past ``timeout_s`` of CPU time (engine/grammar_probe.py), then the compile
whose result is used, here. The
caller gets a future of the compiled grammar and the CPU seconds it cost,
for billing; a cache hit costs none. The gateway bounds a grammar's size
before it gets here (gateway/response_format.py) and how many one tenant
compiles at once.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr
from tokenizers import Tokenizer

from engine.grammar import GrammarMatcher, GrammarSpec, compile_spec, tokenizer_info
from engine.grammar_cache import GrammarCache
from engine.grammar_probe import ProbePool, run_at_compile_priority

SHARED_SCOPE = ""  # the one scope of a cache shared by all tenants


@dataclass(frozen=True)
class Compiled:
    grammar: xgr.CompiledGrammar
    cpu_s: float  # CPU seconds this caller's compile took, trial included; 0 for a cache hit


class GrammarCompiler:
    """Compiles grammar specs for one model's vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 timeout_s: float = 5.0, workers: int = 2, cache_bytes: int = 64 * 2**20,
                 shared_cache: bool = False) -> None:
        if not timeout_s > 0:  # the trial's CPU timer: zero would mean none
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self._info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        # Models without a stop token (random test models) end where their grammar cannot go on.
        self.ends_without_stop_token = not stop_token_ids
        self.timeout_s = timeout_s
        self.cache = GrammarCache(cache_bytes)
        self._shared = shared_cache
        # No cache of xgrammar's own: it would be shared by tenants and bounded apart from ours.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        # Serialized once: a worker killed at its budget is replaced without serializing the vocabulary again.
        self._probes = ProbePool(functools.cache(self._info.serialize_json), workers)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile",
                                           initializer=run_at_compile_priority)
        self._count_lock = threading.Lock()
        self.compiles = 0  # compiles run in this process, cache misses all: what tests count

    def scope(self, tenant: str | None) -> str:
        """The cache scope of ``tenant``'s grammars."""
        return SHARED_SCOPE if self._shared or tenant is None else tenant

    def cached(self, spec: GrammarSpec, tenant: str | None = None) -> xgr.CompiledGrammar | None:
        return self.cache.get(self.scope(tenant), spec)

    def submit(self, spec: GrammarSpec, tenant: str | None = None) -> Future[Compiled]:
        """The compiled grammar, as a future: GrammarError (CompileTimeout past the budget) if it fails."""
        hit = self.cached(spec, tenant)
        if hit is not None:
            done: Future[Compiled] = Future()
            done.set_result(Compiled(hit, 0.0))
            return done
        return self._threads.submit(self._compile, spec, self.scope(tenant))

    def compile(self, spec: GrammarSpec, tenant: str | None = None) -> xgr.CompiledGrammar:
        """Blocking :meth:`submit`, for callers off any event loop (benches, tests, scripts)."""
        return self.submit(spec, tenant).result().grammar

    def matcher(self, grammar: xgr.CompiledGrammar | GrammarSpec) -> GrammarMatcher:
        """A matcher of a compiled grammar (a spec is compiled first, blocking: not for event loops)."""
        if isinstance(grammar, GrammarSpec):
            grammar = self.compile(grammar)
        vocab_size = self.vocab_size if self.ends_without_stop_token else None
        return GrammarMatcher(xgr.GrammarMatcher(grammar), vocab_size)

    def warm(self) -> None:
        """Start a trial worker in the background, so that a server's first grammar does not wait for it."""
        self._threads.submit(self._probes.warm)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._probes.close()

    def _compile(self, spec: GrammarSpec, scope: str) -> Compiled:
        hit = self.cache.get(scope, spec)  # compiled by another request while this one waited
        if hit is not None:
            return Compiled(hit, 0.0)
        trial_s = self._probes.probe(spec, self.timeout_s)
        started = time.thread_time()
        compiled = compile_spec(self._compiler, spec)
        spent = trial_s + time.thread_time() - started
        with self._count_lock:
            self.compiles += 1
        self.cache.put(scope, spec, compiled)
        return Compiled(compiled, spent)
