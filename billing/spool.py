"""The local spool: an append-only JSON-lines file of usage records the database could not take yet.

Each append is fsynced before it returns, so a record handed to the spool survives SIGKILL and
power loss. Replay claims the file by renaming it, so appends never race with a truncate.
One process owns a spool path.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from billing.usage import UsageRecord

log = logging.getLogger(__name__)


class Spool:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.claimed_path = self.path.with_name(self.path.name + ".replaying")
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
