"""Ledger rows of requests still running: who holds them, their saved progress, and closing a dead process's rows.

A request's row is opened (status `open`) at admission by the process serving
it, named by PROCESS_OWNER; `save_progress` writes the token counts and
GPU-seconds of running requests now and then, and stamps `finished_at` with the
time, so an open row's `finished_at` is its last sign of life. When a process
dies, `close_orphans` (run by every process at start and periodically) closes
its rows as `interrupted` with the counts last saved: at once for a process of
this host known to be gone, after `orphan_after_s` of silence for any other.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Engine, bindparam, select, update

from billing.models import UsageEntry
from billing.usage_record import utc_datetime

log = logging.getLogger(__name__)

# host/pid/a random token: the token tells this process from an earlier one that had the same pid
# (a restarted container's process is often pid 1 again).
PROCESS_OWNER = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Progress:
    """What a running request has used so far."""

    request_id: str
    completion_tokens: int
    gpu_seconds: float


_LEDGER = UsageEntry.__table__
_SAVE = (
    update(_LEDGER)
    .where(_LEDGER.c.request_id == bindparam("rid"), _LEDGER.c.status == "open")
    .values(completion_tokens=bindparam("tokens"), gpu_seconds=bindparam("gpu"), finished_at=bindparam("at"))
)


def save_progress(engine: Engine, progress: Iterable[Progress], now: float | None = None) -> None:
    """Write the counts of running requests into their open rows, in one transaction."""
    at = utc_datetime(time.time() if now is None else now)
    rows = [{"rid": p.request_id, "tokens": p.completion_tokens, "gpu": p.gpu_seconds, "at": at} for p in progress]
    if rows:
        with engine.begin() as connection:
            connection.execute(_SAVE, rows)


def close_orphans(engine: Engine, orphan_after_s: float, me: str = PROCESS_OWNER, now: float | None = None) -> int:
    """Close as `interrupted` the open rows of processes that are gone; returns how many were closed."""
    silent_since = utc_datetime((time.time() if now is None else now) - orphan_after_s)
    with engine.begin() as connection:
        open_rows = connection.execute(
            select(_LEDGER.c.request_id, _LEDGER.c.owner, _LEDGER.c.finished_at).where(_LEDGER.c.status == "open")
        ).all()
        orphans = [rid for rid, owner, saved_at in open_rows
                   if owner != me and (saved_at < silent_since or _gone(owner, me))]
        if not orphans:
            return 0
        connection.execute(
            update(_LEDGER).where(_LEDGER.c.request_id == bindparam("rid"), _LEDGER.c.status == "open")
            .values(status="interrupted"),
            [{"rid": rid} for rid in orphans],
        )
    log.warning("ledger: closed %d request(s) left open by a process that is gone as interrupted", len(orphans))
    return len(orphans)


def _gone(owner: str | None, me: str) -> bool:
    """Whether `owner` was a process of this host that no longer runs (False when that cannot be told)."""
    if owner is None:
        return True
    host, _, rest = owner.partition("/")
    pid_text, _, token = rest.partition("/")
    my_host, _, my_rest = me.partition("/")
    if host != my_host or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return token != my_rest.partition("/")[2]  # this pid, an earlier process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, someone else's
    return False
