"""What callers on other threads send the engine thread, and the queue that carries it."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from engine.request_state import RequestState


@dataclass(frozen=True)
class AddRequest:
    state: RequestState  # the first choice's; its siblings hang off its group
    error: BaseException | None = None  # the adapter prefetch failed: refuse the request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class UnregisterAdapter:
    name: str
    done: Future[None]  # resolved once the adapter's requests ended and it is unloaded


Message = AddRequest | AbortRequest | UnregisterAdapter


class Inbox:
    """Many writers, one reader (the engine thread), which sleeps on it while idle."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wakeup = threading.Event()

    def put(self, message: Message) -> None:
        self._queue.put(message)
        self._wakeup.set()

    def wake(self) -> None:
        self._wakeup.set()

    def has_messages(self) -> bool:
        """Whether anything is waiting (cheap: the engine asks between a step's layers)."""
        return not self._queue.empty()

    def take_all(self) -> list[Message]:
        messages = []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages

    def wait(self, timeout_s: float) -> None:
        """Sleep until a message or a wake(), at most ``timeout_s``."""
        self._wakeup.wait(timeout=timeout_s)
        self._wakeup.clear()
