"""The serving process's C heap: glibc's malloc told to hand freed memory back to the system.

A request's transient buffers are large and short-lived: a megabyte body and its
parsed JSON, a prompt's activations and its scores through the LM head (rows times
the vocabulary), a grammar's compile. They are freed, but glibc keeps what it frees
unless told otherwise: each thread that allocates (the event loop, the engine thread,
the tokenizer and worker pools, xgrammar's and torch's own threads) gets an arena of
its own (up to eight per core), and after the first large buffer is freed glibc raises
its mmap threshold (up to 32 MB), so later large buffers come from those arenas, where
freed memory is kept, fragmented, for reuse. Under traffic that sends each such size
once in a while the resident set ratchets up and never comes down.

``tune()`` caps the arenas, fixes the mmap threshold (large buffers are mapped and
unmapped, never kept), and ``trim()`` (run every few seconds by ``trim_forever``)
returns the free pages inside the heaps. Both do nothing off glibc (``mallopt`` is
glibc's; other allocators keep their own policies).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import anyio
import anyio.to_thread

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENA_MAX = 2  # the event loop's and the engine thread's: other threads share them
MMAP_THRESHOLD = 1 << 20  # buffers of a megabyte or more are mapped on their own and unmapped when freed
TRIM_THRESHOLD = 16 << 20  # free memory at a heap's top beyond this goes back at once
TRIM_EVERY_S = 5.0

_lock = threading.Lock()  # trim() from the background task and a caller's at once: one at a time


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune() -> bool:
    """Set glibc's malloc for a long-lived server; whether it applied (False off glibc)."""
    libc = _libc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, ARENA_MAX), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    if not ok:
        log.warning("glibc's mallopt refused a setting; the heap keeps its defaults")
    return ok


def trim() -> bool:
    """Give the free pages of every heap back to the system; whether any were."""
    libc = _libc()
    if libc is None:
        return False
    with _lock:
        return bool(libc.malloc_trim(0))


async def trim_forever(every_s: float = TRIM_EVERY_S) -> None:
    """Until cancelled: trim on a worker thread every ``every_s`` (a trim walks the heaps: milliseconds)."""
    while True:
        await anyio.sleep(every_s)
        await anyio.to_thread.run_sync(trim)
