"""The usage ledger's writer: one committed row per request, spooled locally while the database is down.

write() returns only once the record is durable: committed in the database, or fsynced to the
spool. Spooled records are replayed at start and by a background thread; inserts skip request
ids already present (ON CONFLICT DO NOTHING), so a record written twice is stored once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import InterfaceError, OperationalError

from billing.models import RecomputeCharge, UsageEntry
from billing.spool import Spool
from billing.usage import UsageRecord

log = logging.getLogger(__name__)

# What a database that is down, restarting or locked raises; anything else is a bug and propagates.
UNAVAILABLE = (OperationalError, InterfaceError)
# The dialects whose INSERT has ON CONFLICT DO NOTHING.
_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


class Ledger:
    def __init__(
        self, engine: Engine, spool_path: str | os.PathLike[str], retry_interval_s: float = 2.0
    ) -> None:
        self.engine = engine
        self.spool = Spool(spool_path)
        self.retry_interval_s = retry_interval_s
        self._stop = threading.Event()
        self._replay_lock = threading.Lock()
        self._retry_thread: threading.Thread | None = None

    def start(self) -> None:
        """Replay what an earlier run spooled, then keep retrying in the background."""
        self.replay()
        self._retry_thread = threading.Thread(target=self._retry_loop, name="ledger-replay", daemon=True)
        self._retry_thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._retry_thread is not None:
            self._retry_thread.join()
            self._retry_thread = None

    def __enter__(self) -> Ledger:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def write(self, record: UsageRecord) -> bool:
        """Make `record` durable; True if it is in the database, False if it waits in the spool."""
        return self.write_many([record])

    def write_many(self, records: list[UsageRecord]) -> bool:
        """Make `records` durable in one transaction (or one spool pass); True if in the database."""
        try:
            with self.engine.begin() as connection:
                insert_records(connection, records)
            return True
        except UNAVAILABLE as exc:
            log.warning("ledger: database unavailable, spooling %d record(s): %s", len(records), _first_line(exc))
            self.spool.append_many(records)
            return False

    def replay(self) -> int:
        """Move spooled records into the database; returns how many were new there (0 if it is down)."""
        # One replay at a time: a second one could release a claim the first has not read.
        with self._replay_lock:
            records = self.spool.claim()
            if not records:
                self.spool.release()  # a claimed file holding only a torn line
                return 0
            try:
                with self.engine.begin() as connection:
                    inserted = insert_records(connection, records)
            except UNAVAILABLE as exc:
                log.warning("ledger: replay of %d record(s) postponed: %s", len(records), _first_line(exc))
                return 0
            self.spool.release()
        log.info("ledger: replayed %d spooled record(s), %d new", len(records), inserted)
        return inserted

    def _retry_loop(self) -> None:
        while not self._stop.wait(self.retry_interval_s):
            if self.spool.pending():
                try:
                    self.replay()
                except Exception:  # the loop must outlive any one failure; the spool keeps the rows
                    log.exception("ledger: replay failed")


def insert_records(connection: Connection, records: Iterable[UsageRecord]) -> int:
    """Insert records whose request id is not in the ledger yet; returns how many were inserted."""
    insert = _INSERTS.get(connection.dialect.name)
    if insert is None:
        raise NotImplementedError(f"the ledger supports PostgreSQL and SQLite, not {connection.dialect.name}")
    inserted = 0
    for record in records:
        values = record.ledger_values()
        stmt = (
            insert(UsageEntry)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["request_id"])
        )
        if connection.execute(stmt).rowcount != 1:
            continue  # already recorded, charges included (they commit with the row)
        inserted += 1
        if record.recompute_by_tier:
            connection.execute(
                insert(RecomputeCharge),
                [
                    {"request_id": record.request_id, "charged_tier": tier, "gpu_seconds": seconds,
                     "finished_at": values["finished_at"]}
                    for tier, seconds in record.recompute_by_tier.items()
                ],
            )
    return inserted


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
