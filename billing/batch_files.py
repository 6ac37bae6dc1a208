"""The Batch API's files: stored whole in the database, each visible only to the tenant that owns it.

A file lives in the database because every replica must read what another took in (an input
file, a batch's output) with no store beyond the one billing already runs; OpenAI's limit of
200 MB per file keeps a row within what SQLite and PostgreSQL hold.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, insert, select

from billing.batch_models import BatchFile

_FILES = BatchFile.__table__


@dataclass(frozen=True)
class FileInfo:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    line_count: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


_INFO_COLUMNS = (_FILES.c.id, _FILES.c.tenant, _FILES.c.purpose, _FILES.c.filename, _FILES.c.bytes,
                 _FILES.c.line_count, _FILES.c.created_at)


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def insert_file(connection: Connection, tenant: str, purpose: str, filename: str, content: bytes,
                line_count: int, file_id: str | None = None) -> FileInfo:
    """Store a file within the caller's transaction (a batch's output goes in with its final status)."""
    info = FileInfo(file_id or new_file_id(), tenant, purpose, filename, len(content), line_count, int(time.time()))
    connection.execute(insert(_FILES).values(
        id=info.id, tenant=tenant, purpose=purpose, filename=filename, bytes=info.bytes,
        line_count=line_count, created_at=info.created_at, content=content))
    return info


def create_file(db: Engine, tenant: str, purpose: str, filename: str, content: bytes, line_count: int) -> FileInfo:
    with db.begin() as connection:
        return insert_file(connection, tenant, purpose, filename, content, line_count)


def get_file(db: Engine, tenant: str, file_id: str) -> FileInfo | None:
    """The tenant's file, or None: another tenant's file is as unknown as one that never was."""
    with db.connect() as connection:
        row = connection.execute(select(*_INFO_COLUMNS).where(_FILES.c.id == file_id,
                                                              _FILES.c.tenant == tenant)).first()
    return None if row is None else FileInfo(*row)


def file_content(db: Engine, tenant: str, file_id: str) -> bytes | None:
    with db.connect() as connection:
        return connection.execute(select(_FILES.c.content).where(_FILES.c.id == file_id,
                                                                 _FILES.c.tenant == tenant)).scalar()


def list_files(db: Engine, tenant: str, purpose: str | None = None, after: str | None = None,
               limit: int = 10000, order: str = "desc") -> tuple[list[FileInfo], bool]:
    """The tenant's files newest first (or oldest first), after the cursor ``after``; and whether more follow."""
    query = select(*_INFO_COLUMNS).where(_FILES.c.tenant == tenant)
    if purpose is not None:
        query = query.where(_FILES.c.purpose == purpose)
    newest_first = order == "desc"
    with db.connect() as connection:
        if after is not None:
            cursor = connection.execute(select(_FILES.c.created_at).where(
                _FILES.c.id == after, _FILES.c.tenant == tenant)).scalar()
            if cursor is not None:
                query = query.where(_after(cursor, after, newest_first))
        order_by = (_FILES.c.created_at.desc(), _FILES.c.id.desc()) if newest_first \
            else (_FILES.c.created_at, _FILES.c.id)
        rows = connection.execute(query.order_by(*order_by).limit(limit + 1)).all()
    return [FileInfo(*row) for row in rows[:limit]], len(rows) > limit


def _after(created_at: int, file_id: str, newest_first: bool):
    c = _FILES.c
    if newest_first:
        return (c.created_at < created_at) | ((c.created_at == created_at) & (c.id < file_id))
    return (c.created_at > created_at) | ((c.created_at == created_at) & (c.id > file_id))


def delete_file(db: Engine, tenant: str, file_id: str) -> bool:
    with db.begin() as connection:
        return connection.execute(delete(_FILES).where(_FILES.c.id == file_id, _FILES.c.tenant == tenant)).rowcount > 0
