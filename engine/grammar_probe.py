"""Trial compiles in worker processes that can be killed: what gives a grammar compile a hard time budget.

xgrammar cannot stop a compile under way and a thread cannot be killed, so a
grammar that compiles for minutes would hold a thread and a core that long. A
worker process compiles the grammar first; past the budget it is killed (and
replaced on its next use) and the grammar refused. The caller then compiles a
grammar that passed again in its own process (engine/grammar_compiler.py):
copying a compiled grammar between processes costs more than compiling it
again (serializing its token masks is slower than building them), and the
trial has shown that this compile ends within the budget.

The budget is CPU time, the grammar's own cost: compiles run only on CPU the
engine leaves idle (``run_at_compile_priority``), so on a busy machine a
compile's wall time says more about the load than about the grammar. The
kernel ends a trial at its budget (an ``ITIMER_PROF`` timer, whose signal kills
the worker). A trial that gets so little CPU that it has not ended after
``STARVED_AFTER`` times its budget in wall time is stopped too, as the
server's fault, not the grammar's (``CompileStarved``).

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
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from engine.grammar import GrammarError, GrammarSpec

log = logging.getLogger(__name__)

# Where the idle scheduling class is not available, compiles run this much nicer than the engine.
COMPILE_NICENESS = 10
# A trial not ended after this many times its CPU budget in wall time is starved of CPU: stopped, not refused.
STARVED_AFTER = 4.0

# A worker's start: the fork server's first start imports torch and xgrammar.
READY_TIMEOUT_S = 120.0
_PRELOAD = ["engine.grammar"]


class CompileTimeout(GrammarError):
    """The trial compile ran past its CPU budget and was killed; ``cpu_s`` is what it spent."""

    def __init__(self, budget_s: float, cpu_s: float) -> None:
        super().__init__(f"compiling it takes longer than the budget of {budget_s:g} s")
        self.cpu_s = cpu_s


class CompileStarved(Exception):
    """The trial got too little CPU to end in ``STARVED_AFTER`` times its budget: the machine is too busy, and
    the grammar is neither refused nor cached; ``cpu_s`` is what it spent."""

    def __init__(self, cpu_s: float) -> None:
        super().__init__("the server is too busy to compile this grammar now")
        self.cpu_s = cpu_s


def run_at_compile_priority() -> None:
    """Run the calling thread in Linux's idle scheduling class (Linux keeps it per thread, and a new thread
    starts with its creator's): it gets a core only when no engine or gateway thread wants it, and a waking
    engine thread takes the core back at once; merely nicer threads still delay the engine's every step.
    Where the class cannot be set, ``COMPILE_NICENESS`` nicer (at most 19); where neither, nothing changes."""
    thread = threading.get_native_id()
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + COMPILE_NICENESS))
    except (AttributeError, OSError):
        pass


def _process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run (user and system); 0 where /proc cannot tell. Read from /proc
    rather than through psutil, which is only a test dependency: two fields of one line."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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
            spec, budget_s = conn.recv()
        except (EOFError, OSError):
            return
        started = time.process_time()
        error = None
        # SIGPROF's default action ends the process: the kernel stops a compile at its CPU budget,
        # inside xgrammar's C++ as anywhere.
        signal.setitimer(signal.ITIMER_PROF, budget_s)
        try:
            compile_spec(compiler, spec)
        except GrammarError as exc:
            error = str(exc)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        conn.send((error, time.process_time() - started))


class _Worker:
    """One worker process, started on first use and after it was killed."""

    def __init__(self, context, tokenizer_json: Callable[[], str]) -> None:
        self._context = context
        self._tokenizer_json = tokenizer_json
        self._process = None
        self._conn: Connection | None = None

    def run(self, spec: GrammarSpec, budget_s: float) -> float:
        """CPU seconds the trial took; GrammarError if it cannot compile, CompileTimeout past the CPU budget,
        CompileStarved past ``STARVED_AFTER`` times it in wall time."""
        conn = self._started()
        assert self._process is not None
        pid, cpu_before = self._process.pid, _process_cpu_s(self._process.pid)
        try:
            conn.send((spec, budget_s))
            if conn.poll(STARVED_AFTER * budget_s):
                error, cpu_s = conn.recv()
                if error is not None:
                    raise GrammarError(error)
                return cpu_s
        except (EOFError, OSError):
            if self.kill() == -signal.SIGPROF:
                raise CompileTimeout(budget_s, budget_s) from None
            # It died otherwise (out of memory, a crash): this grammar is not served.
            raise GrammarError("the grammar compiler failed on it") from None
        spent = _process_cpu_s(pid) - cpu_before
        self.kill()
        raise CompileStarved(max(0.0, spent))

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

    def kill(self) -> int | None:
        """Stop the worker (if any); its exit code (negative: the signal that ended it)."""
        exitcode = None
        if self._process is not None:
            self._process.kill()
            self._process.join()
            exitcode = self._process.exitcode
            self._process.close()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        return exitcode


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
        """Start every worker now (the first start imports torch and xgrammar in the fork server), so that
        no request's compile waits for one."""
        taken = [self._idle.get() for _ in self._all]
        try:
            for worker in taken:
                if self._closed.is_set():  # the server stopped while this started: start no more
                    return
                worker.start()
        finally:
            for worker in taken:
                self._idle.put(worker)

    def close(self) -> None:
        self._closed.set()
        for worker in self._all:
            try:
                worker.kill()
            except Exception:  # a worker in use by a compile thread: killed there, or at exit
                log.debug("grammar probe worker not stopped", exc_info=True)
