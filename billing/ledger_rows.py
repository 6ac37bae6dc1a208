"""How usage records become ledger rows: one row per request id, an upsert that only a final record can close.

A new request id is inserted; a final record closes the request's `open` row (or an
`interrupted` one, when the record is the truth a crash had hidden); anything else (a
record written twice, an `open` record arriving after its final one) changes nothing.
Recompute charges go in with a row newly closed, in the same transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from sqlalchemy import Connection, or_
from sqlalchemy.dialects import postgresql, sqlite

from billing.models import RecomputeCharge, UsageEntry
from billing.usage_record import UsageRecord

# Rows a final record may still close.
REOPENABLE = ("open", "interrupted")
# The dialects whose INSERT has ON CONFLICT ... DO UPDATE.
INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def insert_records(connection: Connection, records: Iterable[UsageRecord]) -> int:
    """Insert or close each record's row (see statements); returns how many rows changed."""
    insert = INSERTS.get(connection.dialect.name)
    if insert is None:
        raise NotImplementedError(f"the ledger supports PostgreSQL and SQLite, not {connection.dialect.name}")
    # RETURNING, not rowcount: psycopg 3 reports -1 for statements SQLAlchemy adds RETURNING to.
    _, charge, entry = statements(insert)
    inserted = 0
    for record in records:
        values = record.ledger_values()
        if connection.execute(entry, values).first() is None:
            continue  # already closed, charges included (they commit with the row)
        inserted += 1
        if record.recompute_by_tier:
            connection.execute(
                charge,
                [
                    {"request_id": record.request_id, "charged_tier": tier, "gpu_seconds": seconds,
                     "finished_at": values["finished_at"]}
                    for tier, seconds in record.recompute_by_tier.items()
                ],
            )
    return inserted


@functools.cache
def statements(insert) -> tuple:
    """(ledger row upsert, recompute charge insert, the upsert returning the request ids it changed)."""
    statement = insert(UsageEntry)
    table = UsageEntry.__table__
    columns = [c.name for c in table.columns if c.name not in ("id", "request_id")]
    upsert = statement.on_conflict_do_update(
        index_elements=["request_id"],
        set_={name: statement.excluded[name] for name in columns},
        # Equalities, not IN: an IN list is an "expanding" parameter, which executemany refuses.
        where=or_(*(table.c.status == status for status in REOPENABLE)) & (statement.excluded.status != "open"),
    )
    return upsert, insert(RecomputeCharge), upsert.returning(UsageEntry.request_id)
