"""Batch intake: files stored as chunks, batches validated after creation under a lease, a queue limit per tenant.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHUNK_BYTES = 1 << 20  # billing/batch_files.py's CHUNK_BYTES when this was written
DEFAULT_BATCH_QUEUE_TOKENS = 20_000_000  # the server-wide setting this column replaces had this default

_files = sa.table("batch_files", sa.column("id", sa.String), sa.column("content", sa.LargeBinary))
_chunks = sa.table("batch_file_chunks", sa.column("file_id", sa.String), sa.column("seq", sa.Integer),
                   sa.column("data", sa.LargeBinary))


def upgrade() -> None:
    op.add_column("tenants", sa.Column("batch_queue_tokens", sa.BigInteger(), nullable=False,
                                       server_default=str(DEFAULT_BATCH_QUEUE_TOKENS)))
    op.add_column("batches", sa.Column("validation_owner", sa.String(128), nullable=True))
    op.add_column("batches", sa.Column("validation_until", sa.Float(), nullable=True))
    op.create_table(
        "batch_file_chunks",
        sa.Column("file_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["batch_files.id"], name=op.f("fk_batch_file_chunks_file_id_batch_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_batch_file_chunks")),
    )
    connection = op.get_bind()
    # One file at a time, so the copy holds at most one file (200 MB at most) in memory.
    for (file_id,) in connection.execute(sa.select(_files.c.id)).all():
        content = connection.execute(sa.select(_files.c.content).where(_files.c.id == file_id)).scalar() or b""
        for seq, start in enumerate(range(0, len(content), CHUNK_BYTES)):
            connection.execute(sa.insert(_chunks).values(file_id=file_id, seq=seq,
                                                         data=content[start:start + CHUNK_BYTES]))
    # In place (SQLite 3.35+ drops a column without a table copy).
    op.drop_column("batch_files", "content")


def downgrade() -> None:
    # Nullable: SQLite cannot add a NOT NULL column without a default; every row gets its content back below.
    op.add_column("batch_files", sa.Column("content", sa.LargeBinary(), nullable=True))
    connection = op.get_bind()
    for (file_id,) in connection.execute(sa.select(_files.c.id)).all():
        data = connection.execute(sa.select(_chunks.c.data).where(_chunks.c.file_id == file_id)
                                  .order_by(_chunks.c.seq)).scalars()
        connection.execute(sa.update(_files).where(_files.c.id == file_id).values(content=b"".join(data)))
    op.drop_table("batch_file_chunks")
    op.drop_column("batches", "validation_until")
    op.drop_column("batches", "validation_owner")
    op.drop_column("tenants", "batch_queue_tokens")
