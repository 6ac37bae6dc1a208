"""The Batch API's files: stored in the database a chunk a row, each visible only to the tenant that owns it.

A file lives in the database because every replica must read what another took in (an input
file, a batch's output) with no store beyond the one billing already runs. Its bytes are rows of
``batch_file_chunks`` of at most CHUNK_BYTES each, written and read one at a time, so storing or
serving a file of OpenAI's 200 MB holds one chunk in memory, not the file; an upload's chunks go in
one transaction, so a file refused midway (not JSONL, too large) leaves nothing behind.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, insert, select, update

from billing.batch_models import BatchFile, BatchFileChunk

_FILES = BatchFile.__table__
_CHUNKS = BatchFileChunk.__table__
CHUNK_BYTES = 1 << 20


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
                line_count: int) -> FileInfo:
    """Store a file within the caller's transaction (a batch's output goes in with its final status)."""
    return _insert_chunks(connection, tenant, purpose, filename,
                          (content[i:i + CHUNK_BYTES] for i in range(0, len(content), CHUNK_BYTES)), lambda: line_count)


def store_file(db: Engine, tenant: str, purpose: str, filename: str, chunks: Iterable[bytes],
               line_count: Callable[[], int]) -> FileInfo:
    """Store a file as ``chunks`` arrive, a chunk in memory at a time; ``line_count()`` is asked once they are all
    in. If iterating ``chunks`` raises (the upload's check refused a line), the transaction is rolled back and
    nothing is stored."""
    with db.begin() as connection:
        return _insert_chunks(connection, tenant, purpose, filename, chunks, line_count)


def _insert_chunks(connection: Connection, tenant: str, purpose: str, filename: str, chunks: Iterable[bytes],
                   line_count: Callable[[], int]) -> FileInfo:
    file_id, created_at = new_file_id(), int(time.time())
    # The file's row first (its chunks refer to it); its size and lines are known once they are in.
    connection.execute(insert(_FILES).values(id=file_id, tenant=tenant, purpose=purpose, filename=filename, bytes=0,
                                             line_count=0, created_at=created_at))
    size = seq = 0
    for chunk in _sized(chunks):
        connection.execute(insert(_CHUNKS).values(file_id=file_id, seq=seq, data=chunk))
        size += len(chunk)
        seq += 1
    lines = line_count()
    connection.execute(update(_FILES).where(_FILES.c.id == file_id).values(bytes=size, line_count=lines))
    return FileInfo(file_id, tenant, purpose, filename, size, lines, created_at)


def _sized(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``chunks`` regrouped into rows of CHUNK_BYTES (the last one shorter): few rows, each bounded."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while len(pending) >= CHUNK_BYTES:
            with memoryview(pending) as view:  # one copy out, not a bytearray slice and then its bytes
                row = bytes(view[:CHUNK_BYTES])
            del pending[:CHUNK_BYTES]
            yield row
    if pending:
        yield bytes(pending)


def get_file(db: Engine, tenant: str, file_id: str) -> FileInfo | None:
    """The tenant's file, or None: another tenant's file is as unknown as one that never was."""
    with db.connect() as connection:
        row = connection.execute(select(*_INFO_COLUMNS).where(_FILES.c.id == file_id,
                                                              _FILES.c.tenant == tenant)).first()
    return None if row is None else FileInfo(*row)


def file_chunks(db: Engine, tenant: str, file_id: str) -> Iterator[bytes] | None:
    """The tenant's file's bytes a chunk at a time (one query each, so no connection stays open between them), or
    None if it has no such file. A file deleted while it is read ends early."""
    if get_file(db, tenant, file_id) is None:
        return None
    return _chunks_of(db, file_id)


def _chunks_of(db: Engine, file_id: str) -> Iterator[bytes]:
    seq = 0
    while True:
        with db.connect() as connection:
            data = connection.execute(select(_CHUNKS.c.data).where(_CHUNKS.c.file_id == file_id,
                                                                   _CHUNKS.c.seq == seq)).scalar()
        if data is None:
            return
        yield bytes(data)
        seq += 1


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
        if connection.execute(select(_FILES.c.id).where(_FILES.c.id == file_id, _FILES.c.tenant == tenant)
                              ).first() is None:
            return False
        # Explicitly, not only by the foreign key's cascade: a SQLite connection without foreign_keys on skips it.
        connection.execute(delete(_CHUNKS).where(_CHUNKS.c.file_id == file_id))
        return connection.execute(delete(_FILES).where(_FILES.c.id == file_id)).rowcount > 0
