"""The usage ledger's writer: one committed row per request, spooled locally while the database is down.

write() returns only once the record is durable: committed in the database, or fsynced to the
spool. Spooled records are replayed at start and by a background thread. A request has one row,
keyed by its id: opened at admission (status `open`, billing.open_rows), closed by its final
record; a record written twice is stored once (billing.ledger_rows).

submit() is the same promise for callers that should not block (the gateway's event loop): a
writer thread group-commits whatever arrived together in one transaction and resolves each
caller's future only once its rows are durable. One writer also means this process never
contends with itself for SQLite's write lock, whose busy handler sleeps whole milliseconds.
write_now() is for a caller with one row while the ledger is quiet, on a SQLite file only:
it commits on the caller's thread if that cannot wait (nothing queued, SQLite's lock free),
because there a commit costs less than the handoff to the writer and back; otherwise it
declines and the row goes through submit().

On SQLite these commits skip the automatic WAL checkpoint (a few ms of fsync inside one
unlucky commit); a background thread checkpoints instead. Checkpoints only move committed
pages from the WAL into the database file, so durability does not change: a committed row
survives the process being killed (synchronous=NORMAL, see billing.db).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy import Connection, Engine

from billing.db import UNAVAILABLE
from billing.ledger_inline import InlineSqlite
from billing.ledger_rows import INSERTS, insert_records, statements
from billing.open_rows import Progress, save_progress
from billing.spool import Spool
from billing.usage_record import UsageRecord
from tiergate_common.errors import first_line


log = logging.getLogger(__name__)

# Bounds one group commit, so a flood's backlog cannot become one huge transaction.
MAX_BATCH_RECORDS = 1000
# When the checkpointer runs: after this many rows (a row dirties ~5 pages, so about SQLite's own
# 1000-page threshold), at most this often, and at least this often while rows keep coming.
CHECKPOINT_EVERY_ROWS = 200
CHECKPOINT_MIN_INTERVAL_S = 0.05
CHECKPOINT_INTERVAL_S = 0.5
# The WAL size (pages) past which the checkpointer briefly holds the writer back: a checkpoint
# racing with new commits never lets the WAL start over from its beginning, so it would grow.
WAL_RESET_FRAMES = 4000
_STOP = object()


@dataclass(frozen=True)
class _Progress:
    """A save of running requests' progress, queued for the writer like a batch of records."""

    progress: list[Progress]

    def __len__(self) -> int:
        return len(self.progress)
_NO_AUTOCHECKPOINT = "tiergate_no_autocheckpoint"


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
        # A SQLite file: WAL checkpoints are ours, and write_now() may commit on the caller's thread.
        # (In-memory SQLite has no WAL, and its connections are per thread.)
        self._sqlite = engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:")
        # Statements built once: building an INSERT per row costs more than SQLite's commit.
        insert = INSERTS.get(engine.dialect.name)
        self._statements = None if insert is None else statements(insert)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()  # orders submits against close()'s stop marker
        self._commit_lock = threading.Lock()  # held by the writer per batch; the checkpointer may take it
        self._writer: threading.Thread | None = None
        self._checkpointer: threading.Thread | None = None
        self._unchecked_rows = 0  # rows committed without SQLite's automatic checkpoint since the last one
        self._checkpoint_due = threading.Event()
        self._spool_until = 0.0  # monotonic time before which the writer spools without trying the database
        self._inline: InlineSqlite | None = None  # write_now()'s connection, opened on first use

    def start(self) -> None:
        """Replay what an earlier run spooled, then keep retrying in the background and start the writer."""
        self.replay()
        self._stop.clear()
        self._retry_thread = threading.Thread(target=self._retry_loop, name="ledger-replay", daemon=True)
        self._retry_thread.start()
        with self._submit_lock:
            self._writer = threading.Thread(target=self._write_loop, name="ledger-writer", daemon=True)
            self._writer.start()
        if self._sqlite:
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="ledger-checkpoint", daemon=True)
            self._checkpointer.start()

    def close(self) -> None:
        """Write everything submitted so far, then stop the background threads."""
        with self._submit_lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                self._queue.put(_STOP)
        if writer is not None:
            writer.join()
        with self._commit_lock:
            inline, self._inline = self._inline, None
            if inline is not None:
                inline.close()
        self._stop.set()
        self._checkpoint_due.set()
        for thread in (self._retry_thread, self._checkpointer):
            if thread is not None:
                thread.join()
        self._retry_thread = self._checkpointer = None

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
                self._insert_batch(connection, records)
            return True
        except UNAVAILABLE as exc:
            log.warning("ledger: database unavailable, spooling %d record(s): %s", len(records), first_line(exc))
            self.spool.append_many(records)
            return False

    @property
    def writing(self) -> bool:
        """Whether a writer thread takes submit()'s records (between start() and close())."""
        return self._writer is not None

    def submit(self, records: list[UsageRecord]) -> Future[bool]:
        """Queue `records` for the writer; the future resolves as write_many() would, once they are durable.

        Without a running writer (not started, or closed) the records are written before this returns.
        """
        future: Future[bool] = Future()
        with self._submit_lock:
            if self._writer is not None:
                self._queue.put((records, future))
                return future
        _settle(future, self.write_many, records)
        return future

    def write_now(self, records: list[UsageRecord]) -> bool:
        """Commit `records` on the calling thread if that involves no waiting; False: nothing written, submit() them.

        For an event loop with one row to make durable while the ledger is quiet. Only on SQLite,
        where a commit is an append to the WAL without fsync (the checkpointer does those), and
        the handoff to the writer thread and back costs more than the commit. Never waits: the
        writer busy, a batch queued, or SQLite's lock held by anyone (busy_timeout=0 on this
        connection) all mean False. Never spools: submit() does that, on the writer.
        """
        if (not self._sqlite or self._writer is None or not self._queue.empty()
                or time.monotonic() < self._spool_until or any(r.recompute_by_tier for r in records)):
            return False
        if not self._commit_lock.acquire(blocking=False):
            return False
        try:
            if self._inline is None:
                try:
                    self._inline = InlineSqlite(self.engine)
                except Exception as exc:  # the writer's path reports what is wrong, or waits it out
                    log.warning("ledger: no connection for write_now(): %s", first_line(exc))
                    return False
            if not self._inline.insert(records):
                return False
        finally:
            self._commit_lock.release()
        self._committed(len(records))
        return True

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
                log.warning("ledger: replay of %d record(s) postponed: %s", len(records), first_line(exc))
                return 0
            self.spool.release()
        log.info("ledger: replayed %d spooled record(s), %d new", len(records), inserted)
        return inserted

    # -- the writer thread -------------------------------------------------

    def save_progress(self, progress: list[Progress]) -> Future[bool]:
        """Save running requests' counts into their open rows (billing.open_rows); True once saved, False
        if the database is unavailable (progress is not spooled: the next save supersedes it).

        On the writer thread, so saves never contend with the ledger's own commits for SQLite's lock.
        """
        future: Future[bool] = Future()
        with self._submit_lock:
            if self._writer is not None:
                self._queue.put((_Progress(progress), future))
                return future
        _settle(future, self._save_progress, [_Progress(progress)])
        return future

    def _save_progress(self, saves: list[_Progress]) -> bool:
        try:
            save_progress(self.engine, [p for save in saves for p in save.progress])
        except UNAVAILABLE as exc:
            log.debug("ledger: progress not saved, database unavailable: %s", first_line(exc))
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            batch, stop = self._take_batch()
            saves = [(item, future) for item, future in batch if isinstance(item, _Progress)]
            if saves:
                batch = [(item, future) for item, future in batch if not isinstance(item, _Progress)]
                with self._commit_lock:
                    _settle_all([future for _, future in saves], self._save_progress, [item for item, _ in saves])
            if batch:
                try:
                    with self._commit_lock:
                        self._commit(batch)
                except Exception as exc:  # the writer must neither die nor leave a caller waiting forever
                    log.exception("ledger: writer failed on a batch of %d caller(s)", len(batch))
                    for _, future in batch:
                        _settle_exception(future, exc)
            if stop:
                return

    def _take_batch(self) -> tuple[list[tuple[list[UsageRecord], Future]], bool]:
        """What arrived together (up to MAX_BATCH_RECORDS), waiting for the first; and whether to stop after it."""
        item = self._queue.get()
        batch, size = [], 0
        while item is not _STOP:
            batch.append(item)
            size += len(item[0])
            if size >= MAX_BATCH_RECORDS:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _commit(self, batch: list[tuple[list[UsageRecord], Future]]) -> None:
        records = [record for records, _ in batch for record in records]
        try:
            durable_in_db = self._write_from_writer(records)
        except Exception as exc:
            if len(batch) == 1:
                _settle_exception(batch[0][1], exc)
                return
            # One bad record must not fail the others that happened to share its transaction.
            log.exception("ledger: a group commit of %d record(s) failed; writing them one caller at a time",
                          len(records))
            for records_of_one, future in batch:
                _settle(future, self._write_from_writer, records_of_one)
            return
        for _, future in batch:
            if not future.done():  # a future a caller cancelled takes no result; its rows are written all the same
                future.set_result(durable_in_db)

    def _write_from_writer(self, records: list[UsageRecord]) -> bool:
        # Right after the database failed, go straight to the spool until the next retry is due:
        # one writer waiting out a connect or lock timeout per batch would stall every request.
        if time.monotonic() < self._spool_until:
            self.spool.append_many(records)
            return False
        try:
            with self.engine.begin() as connection:
                if self._sqlite and not connection.info.get(_NO_AUTOCHECKPOINT):
                    connection.exec_driver_sql("PRAGMA wal_autocheckpoint=0")  # the checkpointer's job now
                    connection.info[_NO_AUTOCHECKPOINT] = True
                self._insert_batch(connection, records)
        except UNAVAILABLE as exc:
            self._spool_until = time.monotonic() + self.retry_interval_s
            log.warning("ledger: database unavailable, spooling %d record(s): %s", len(records), first_line(exc))
            self.spool.append_many(records)
            return False
        self._committed(len(records))
        return True

    def _insert_batch(self, connection: Connection, records: list[UsageRecord]) -> None:
        """Insert many records with one statement per table; rows already stored are skipped with their charges."""
        if self._statements is None or any(record.recompute_by_tier for record in records):
            # Charges go in only with a newly inserted row, which needs each row's own rowcount;
            # preempted requests are rare, so the slow path is too.
            insert_records(connection, records)
            return
        connection.execute(self._statements[0], [record.ledger_values() for record in records])

    # -- background threads ------------------------------------------------

    def _retry_loop(self) -> None:
        while not self._stop.wait(self.retry_interval_s):
            if self.spool.pending():
                try:
                    self.replay()
                except Exception:  # the loop must outlive any one failure; the spool keeps the rows
                    log.exception("ledger: replay failed")

    def _committed(self, rows: int) -> None:
        if self._sqlite:
            self._unchecked_rows += rows  # racy by a row or two at worst: it only paces checkpoints
            if self._unchecked_rows >= CHECKPOINT_EVERY_ROWS:
                self._checkpoint_due.set()

    def _checkpoint_loop(self) -> None:
        while True:
            self._checkpoint_due.wait(CHECKPOINT_INTERVAL_S)
            if self._stop.is_set():
                return
            self._checkpoint_due.clear()
            if not self._unchecked_rows:
                continue
            self._unchecked_rows = 0
            try:
                if self._checkpoint() > WAL_RESET_FRAMES:
                    # Commits kept arriving during the checkpoint: one more with the writer held
                    # back copies the rest, so the next commit starts the WAL file over.
                    with self._commit_lock:
                        self._checkpoint()
            except UNAVAILABLE as exc:
                log.debug("ledger: checkpoint postponed: %s", first_line(exc))
            except Exception:
                log.exception("ledger: checkpoint failed")
            self._stop.wait(CHECKPOINT_MIN_INTERVAL_S)  # a flood of rows must not become a flood of fsyncs

    def _checkpoint(self) -> int:
        """A passive checkpoint (it never waits for readers or the writer); returns the WAL's size in pages."""
        with self.engine.connect() as connection:
            row = connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()
        return int(row[1])


def _settle(future: Future, write, records: list[UsageRecord]) -> None:
    try:
        result = write(records)
    except Exception as exc:
        _settle_exception(future, exc)
        return
    if not future.done():
        future.set_result(result)


def _settle_all(futures: list[Future], work, argument) -> None:
    try:
        result = work(argument)
    except Exception as exc:
        for future in futures:
            _settle_exception(future, exc)
        return
    for future in futures:
        if not future.done():
            future.set_result(result)


def _settle_exception(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
