"""Bridges the engine thread to callers: an async iterator of deltas, and a blocking collector."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from engine.request import Delta


class RequestStream:
    """Async iterator over one request's deltas; closing it early aborts the request."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._done = False

    def push(self, delta: Delta) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self._abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if delta.is_last:
            self._done = True
        return delta

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)


class BlockingCollector:
    """Collects one request's deltas for callers without an event loop (benches, tests)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def push(self, delta: Delta) -> None:
        self._queue.put(delta)

    def __iter__(self):
        while True:
            delta = self._queue.get()
            yield delta
            if delta.is_last:
                return
