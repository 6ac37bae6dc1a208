"""Compiled grammars kept for reuse: keyed by scope (a tenant, or one shared scope) and spec, bounded in bytes.

A compile takes seconds for a large grammar and a cache hit takes none, so a
cache shared by tenants tells one tenant, by timing, which grammars another
used; scoping keys by tenant closes that channel, as the prefix cache's
``prefix_cache_scope`` does. The bound counts each entry's own
``memory_size_bytes`` (the adaptive token masks dominate it), and evicts least
recently used first. A grammar larger than the whole bound is not kept; it still
serves the request that compiled it, which holds it until it ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import xgrammar as xgr

from engine.grammar import GrammarSpec

CacheKey = tuple[str, GrammarSpec]


class GrammarCache:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[CacheKey, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # taken by the gateway's loop and the compile threads

    def get(self, scope: str, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get((scope, spec))
            if entry is None:
                return None
            self._entries.move_to_end((scope, spec))
            return entry[0]

    def put(self, scope: str, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        if size > self.limit_bytes:
            return
        with self._lock:
            old = self._entries.pop((scope, spec), None)
            if old is not None:
                self._bytes -= old[1]
            while self._entries and self._bytes + size > self.limit_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
            self._entries[(scope, spec)] = (compiled, size)
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def size_bytes(self) -> int:
        """What the entries report of their memory, summed: never over ``limit_bytes``."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
