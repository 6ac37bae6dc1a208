"""The local spool: an append-only JSON-lines file of usage records the database could not take yet.

Each append is fsynced before it returns, so a record handed to the spool survives SIGKILL and
power loss. Replay claims the file by renaming it, so appends never race with a truncate.

One process owns a spool path, and says so by holding an flock on ``<path>.lock`` while it lives.
``process_spool_path`` names a file of this process's own, so replicas started in one directory
never append to one file; ``adopt_orphans`` moves into a spool the records of sibling files whose
owner died (their lock is free), so a crashed replica's rows are replayed by the next one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import weakref
from pathlib import Path

from billing.usage_record import UsageRecord

log = logging.getLogger(__name__)


class Spool:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.claimed_path = self.path.with_name(self.path.name + ".replaying")
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner_lock = _try_lock(_lock_path(self.path))
        if self._owner_lock is not None:
            weakref.finalize(self, os.close, self._owner_lock)
        else:
            log.warning("spool %s is held by another process; two writers on one spool may interleave", self.path)
        for file in (self.path, self.claimed_path):
            _end_torn_line(file)

    def append(self, record: UsageRecord) -> None:
        self.append_many([record])

    def append_many(self, records: list[UsageRecord]) -> None:
        lines = "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in records)
        with self._lock:
            created = not self.path.exists()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
            if created:
                _fsync_dir(self.path.parent)

    def pending(self) -> bool:
        return self.path.exists() or self.claimed_path.exists()

    def claim(self) -> list[UsageRecord]:
        """Records to replay; they stay on disk until release() after the database took them."""
        with self._lock:
            if not self.claimed_path.exists():
                if not self.path.exists():
                    return []
                os.replace(self.path, self.claimed_path)
                _fsync_dir(self.path.parent)
        return list(_read(self.claimed_path))

    def release(self) -> None:
        with self._lock:
            self.claimed_path.unlink(missing_ok=True)
            _fsync_dir(self.path.parent)


SPOOL_PREFIX = "ledger-"


def process_spool_path(directory: str | os.PathLike[str]) -> Path:
    """A spool file of this process's own in ``directory``: host and pid in its name."""
    return Path(directory) / f"{SPOOL_PREFIX}{socket.gethostname()}-{os.getpid()}.jsonl"


def adopt_orphans(spool: Spool) -> int:
    """Move into ``spool`` the records of sibling spools no live process holds; returns how many.

    A record copied but not yet removed from its orphan (a crash in between) is replayed twice,
    which the ledger's insert skips (request ids are unique), so the copy comes first.
    """
    adopted = 0
    for orphan in sorted(spool.path.parent.glob(f"{SPOOL_PREFIX}*.jsonl*")):
        if orphan.suffix == ".lock" or orphan in (spool.path, spool.claimed_path):
            continue
        owner = orphan.with_name(orphan.name.removesuffix(".replaying"))
        lock = _try_lock(_lock_path(owner))
        if lock is None:
            continue  # its process is alive
        try:
            records = list(_read(orphan)) if orphan.exists() else []
            if records:
                spool.append_many(records)
            orphan.unlink(missing_ok=True)
            _fsync_dir(orphan.parent)
            adopted += len(records)
            if not owner.exists() and not owner.with_name(owner.name + ".replaying").exists():
                _lock_path(owner).unlink(missing_ok=True)
        finally:
            os.close(lock)
    if adopted:
        log.info("spool %s: adopted %d record(s) left by processes that ended", spool.path, adopted)
    return adopted


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on ``path``, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read(path: Path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                # Only a crash mid-append tears a line, and that append() never returned.
                log.warning("spool %s: skipping torn line %d", path, number)
                continue
            yield UsageRecord.from_json(data)


def _end_torn_line(path: Path) -> None:
    """After a crash mid-append, end the torn line so the next record starts on a line of its own."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
