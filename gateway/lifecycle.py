"""Graceful shutdown: counts in-flight requests, refuses new ones while draining, and ends the rest on time.

A drain waits up to its timeout for in-flight requests to finish; the ones
still running then are interrupted (each ends its response with a
``server_shutdown`` error and its ledger row says ``interrupted``), and the
drain waits a short grace for those ends to be written. Also owns the
background tasks that outlive a response (a disconnected stream's ledger
row), so a drain waits for those too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

log = logging.getLogger(__name__)

# After the deadline, how long interrupted requests get to end their responses and write their rows:
# an abort takes effect within one engine step, a row within one commit (or spool append).
INTERRUPT_GRACE_S = 5.0
# Retry-After of a draining replica's 503s: another replica (or this one's successor) can take the
# request at once, and a load balancer that retries does so without waiting.
DRAIN_RETRY_S = 1.0


class Interruptible(Protocol):
    def interrupt(self) -> None:
        """End the request now, as a server shutdown; its response and ledger row follow."""
        ...


class Lifecycle:
    def __init__(self, on_drain: Callable[[], None] | None = None) -> None:
        self.draining = False
        self.in_flight = 0
        self._on_drain = on_drain
        self._requests: set[Interruptible] = set()
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Event | None = None

    def enter(self, request: Interruptible | None = None) -> None:
        """A request was admitted; pair with exactly one ``exit()`` of the same request."""
        self.in_flight += 1
        if request is not None:
            self._requests.add(request)

    def exit(self, request: Interruptible | None = None) -> None:
        self.in_flight -= 1
        self._requests.discard(request)
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def start_draining(self) -> None:
        """Refuse new requests from now on (readiness turns 503); idempotent."""
        if not self.draining:
            self.draining = True
            if self._on_drain is not None:
                self._on_drain()

    async def drain(self, timeout_s: float, grace_s: float = INTERRUPT_GRACE_S) -> bool:
        """Stop admitting, wait up to ``timeout_s``, interrupt what still runs; True if nothing had to be cut."""
        self.start_draining()
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        finished = self._idle.is_set() or await _wait(self._idle.wait(), timeout_s)
        if not finished:
            log.warning("drain deadline: interrupting %d request(s) still in flight", len(self._requests))
            for request in list(self._requests):
                request.interrupt()
            if not (self._idle.is_set() or await _wait(self._idle.wait(), grace_s)):
                log.error("%d request(s) did not end within %.1f s of their interruption", self.in_flight, grace_s)
        deadline = loop.time() + grace_s
        if self._tasks:
            await _wait(asyncio.gather(*self._tasks, return_exceptions=True), max(0.0, deadline - loop.time()))
        return finished


async def _wait(awaitable: Any, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(awaitable, timeout=timeout_s)
        return True
    except TimeoutError:
        return False
