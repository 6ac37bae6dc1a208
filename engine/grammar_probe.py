"""Trial compiles in worker processes that can be killed: what gives a grammar compile a hard time budget.

xgrammar cannot stop a compile under way and a thread cannot be killed, so a
grammar that compiles for minutes would hold a thread and a core that long. A
worker process compiles the grammar first; past the budget it is killed (and
replaced on its next use) and the grammar refused. The caller then compiles a
grammar that passed again in its own process (engine/grammar_compiler.py):
copying a compiled grammar between processes costs more than compiling it
again (serializing its token masks is slower than building them), and the
trial has shown that this compile ends within the budget.

Workers are forked from multiprocessing's fork server, which imports the
grammar code once, so a replacement starts in milliseconds rather than
importing torch and xgrammar again; forking the server itself, which runs
the engine's threads, would not be safe.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from engine.grammar import GrammarError, GrammarSpec

log = logging.getLogger(__name__)

# Compiles, trial and real, run this much nicer than the engine: where the engine keeps the cores busy,
# a tenant's compile takes the CPU the engine leaves rather than slowing every stream (its budget holds).
COMPILE_NICENESS = 10

# A worker's start: the fork server's first start imports torch and xgrammar.
READY_TIMEOUT_S = 120.0
_PRELOAD = ["engine.grammar"]


class CompileTimeout(GrammarError):
    """The trial compile ran past its budget and was killed; ``cpu_s`` is what it spent."""

    def __init__(self, budget_s: float, cpu_s: float) -> None:
        super().__init__(f"compiling it takes longer than the budget of {budget_s:g} s")
        self.cpu_s = cpu_s


def run_at_compile_priority() -> None:
    """Make the calling thread ``COMPILE_NICENESS`` nicer (at most 19; Linux keeps a niceness per thread,
    and a new thread starts with its creator's; where it cannot be set, nothing changes)."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + COMPILE_NICENESS))
    except (AttributeError, OSError):
        pass


def _serve(conn: Connection, tokenizer_json: str) -> None:
    """A worker: compile each spec received, answer (error or None, CPU seconds)."""
    import xgrammar as xgr

    from engine.grammar import compile_spec

    run_at_compile_priority()

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        started = time.process_time()
        error = None
        try:
            compile_spec(compiler, spec)
        except GrammarError as exc:
            error = str(exc)
        conn.send((error, time.process_time() - started))


class _Worker:
    """One worker process, started on first use and after it was killed."""

    def __init__(self, context, tokenizer_json: Callable[[], str]) -> None:
        self._context = context
        self._tokenizer_json = tokenizer_json
        self._process = None
        self._conn: Connection | None = None

    def run(self, spec: GrammarSpec, budget_s: float) -> float:
        """CPU seconds the trial took; GrammarError if it cannot compile, CompileTimeout past the budget."""
        conn = self._started()
        started = time.monotonic()
        try:
            conn.send(spec)
            if conn.poll(budget_s):
                error, cpu_s = conn.recv()
                if error is not None:
                    raise GrammarError(error)
                return cpu_s
        except (EOFError, OSError):  # it died (out of memory, a crash): this grammar is not served
            self.kill()
            raise GrammarError("the grammar compiler failed on it") from None
        self.kill()
        raise CompileTimeout(budget_s, time.monotonic() - started)

    def start(self) -> None:
        self._started()

    def _started(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self.kill()
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(theirs, self._tokenizer_json()),
                                        name="grammar-probe", daemon=True)
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        if not ours.poll(READY_TIMEOUT_S):
            self.kill()
            raise GrammarError("the grammar compiler did not start")
        ours.recv()
        return ours

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._process.close()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


class ProbePool:
    """``workers`` worker processes; ``probe`` takes an idle one (waiting for one if all are busy)."""

    def __init__(self, tokenizer_json: Callable[[], str], workers: int) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        self._all = [_Worker(context, tokenizer_json) for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._all:
            self._idle.put(worker)
        self._closed = threading.Event()

    def probe(self, spec: GrammarSpec, budget_s: float) -> float:
        """Compile ``spec`` in a worker within ``budget_s``; its CPU seconds (see _Worker.run)."""
        worker = self._idle.get()
        try:
            if self._closed.is_set():
                raise GrammarError("the server is shutting down")
            return worker.run(spec, budget_s)
        finally:
            self._idle.put(worker)

    def warm(self) -> None:
        """Start the idle workers now (the first start imports torch and xgrammar in the fork server)."""
        worker = self._idle.get()
        try:
            worker.start()
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        self._closed.set()
        for worker in self._all:
            try:
                worker.kill()
            except Exception:  # a worker in use by a compile thread: killed there, or at exit
                log.debug("grammar probe worker not stopped", exc_info=True)
