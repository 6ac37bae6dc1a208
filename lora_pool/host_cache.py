"""The host (CPU memory) cache of loaded adapters: LRU over `capacity` entries.

Loads from disk happen outside the cache's lock so that a slow read never blocks the
step loop; two threads asking for the same cold adapter share one read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from lora_pool.adapter import AdapterWeights


class HostCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._loading: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from disk

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def get(self, name: str, load: Callable[[], AdapterWeights]) -> AdapterWeights:
        """The adapter's weights, from `load()` (a disk read) if they are not cached.

        `load` must not take locks a waiting caller may hold: a second caller for the same
        name blocks until the first caller's load is done.
        """
        with self._lock:
            if name in self._entries:
                self._entries.move_to_end(name)
                return self._entries[name]
            future = self._loading.get(name)
            owner = future is None
            if owner:
                future = self._loading[name] = Future()
        if not owner:
            return future.result()
        try:
            weights = load()
        except BaseException as exc:
            with self._lock:
                del self._loading[name]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._loading[name]
            self.loads += 1
            self._entries[name] = weights
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        future.set_result(weights)
        return weights

    def discard(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)
