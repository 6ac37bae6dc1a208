"""The serving process's C heap: glibc's malloc told to hand freed memory back to the system.

A request's transient buffers are large and short-lived: a megabyte body and its
parsed JSON, a prompt's activations and its scores through the LM head (rows times
the vocabulary), a grammar's compile. They are freed, but glibc keeps what it frees
for reuse: each thread that allocates (the event loop, the engine thread, the
tokenizer and worker pools, xgrammar's and torch's own threads) gets an arena of its
own, up to eight per core, and after the first large buffer is freed glibc raises its
mmap threshold (up to 32 MB), so later large buffers come from those arenas too.
Under traffic that sends such sizes from many threads the resident set ratchets up
and stays up (tests/gateway/test_memory.py: 250-550 MB kept after six threads' churn).

``tune()`` caps the arenas at two, so freed memory is shared rather than stranded per
thread, and ``trim()``, run every few seconds by ``trim_forever``, returns the free
pages inside them (4 MB kept after the same churn). The mmap threshold is left
dynamic: fixed low, every large buffer would be mapped and faulted in afresh, which
doubled that churn's time. Off glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import anyio
import anyio.to_thread

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)
ARENA_MAX = 2  # the event loop's and the engine thread's: other threads share them
TRIM_EVERY_S = 5.0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The process's own C library when it is glibc (the symbols of the running process)."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune() -> bool:
    """Set glibc's malloc for a long-lived server; whether it applied (False off glibc)."""
    libc = _libc()
    if libc is None:
        return False
    if libc.mallopt(M_ARENA_MAX, ARENA_MAX) != 1:
        log.warning("glibc's mallopt refused M_ARENA_MAX; the heap keeps its defaults")
        return False
    return True


def trim() -> bool:
    """Give the free pages of every heap back to the system; whether any were."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


async def trim_forever(every_s: float = TRIM_EVERY_S) -> None:
    """Until cancelled: trim on a worker thread every ``every_s`` (a trim walks the heaps: milliseconds)."""
    while True:
        await anyio.sleep(every_s)
        await anyio.to_thread.run_sync(trim)
