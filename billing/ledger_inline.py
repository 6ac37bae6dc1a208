"""The ledger's commit on the caller's thread (Ledger.write_now()): one SQLite connection, plain DB-API calls.

SQLAlchemy's per-execute work costs about as much as SQLite's commit of one row,
so this path runs a statement written once. Values still go through the
columns' own SQLAlchemy bind processors, so rows are stored exactly as the
ORM's inserts store them. Only for SQLite files, and only under the ledger's
commit lock: one caller at a time.
"""

from __future__ import annotations

from sqlalchemy import Engine

from billing.models import UsageEntry
from billing.usage_record import UsageRecord


class InlineSqlite:
    """A connection that never waits for SQLite's lock (busy_timeout=0) and leaves checkpoints to others."""

    def __init__(self, engine: Engine) -> None:
        table = UsageEntry.__table__
        self.names = [c.name for c in table.columns if c.name != "id"]
        self.processors = [
            table.c[name].type.dialect_impl(engine.dialect).bind_processor(engine.dialect) for name in self.names
        ]
        # The same upsert as billing.ledger._statements, written out.
        updates = ", ".join(f"{n} = excluded.{n}" for n in self.names if n != "request_id")
        self.sql = (f"INSERT INTO {table.name} ({', '.join(self.names)}) VALUES ({', '.join('?' * len(self.names))}) "
                    f"ON CONFLICT (request_id) DO UPDATE SET {updates} "
                    f"WHERE {table.name}.status IN ('open', 'interrupted') AND excluded.status <> 'open'")
        self.errors = engine.dialect.loaded_dbapi.Error
        self.connection = engine.raw_connection()
        try:
            # Fail at once on a lock held elsewhere; leave WAL checkpoints to the checkpointer.
            self.connection.driver_connection.execute("PRAGMA busy_timeout=0")
            self.connection.driver_connection.execute("PRAGMA wal_autocheckpoint=0")
        except BaseException:
            self.connection.invalidate()
            raise

    def insert(self, records: list[UsageRecord]) -> bool:
        """Insert and commit; False (and nothing stored) on any database error."""
        rows = []
        for record in records:
            values = record.ledger_values()
            rows.append(tuple(v if p is None or v is None else p(v)
                              for v, p in zip([values[n] for n in self.names], self.processors)))
        cursor = self.connection.cursor()
        try:
            cursor.executemany(self.sql, rows)
            self.connection.commit()
            return True
        except self.errors:
            # Busy, locked, or worse: the writer retries through SQLAlchemy, which waits, spools or raises.
            try:
                self.connection.rollback()
            except self.errors:
                pass
            return False
        finally:
            cursor.close()

    def close(self) -> None:
        # Invalidated, not returned: its pragmas must not reach the pool's other users.
        self.connection.invalidate()
