"""Graceful shutdown: counts in-flight requests, refuses new ones while draining, and waits for the rest.

Also owns the background tasks that outlive a response (a disconnected
stream's ledger row), so a drain waits for those too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        """A request was admitted; pair with exactly one ``exit()``."""
        self.in_flight += 1

    def exit(self) -> None:
        self.in_flight -= 1
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

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting, then wait up to ``timeout_s`` for in-flight requests and background tasks."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, deadline - loop.time()))
            if self._tasks:
                await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True),
                                       timeout=max(0.0, deadline - loop.time()))
            return True
        except TimeoutError:
            log.warning("drain timed out with %d request(s) in flight", self.in_flight)
            return False
