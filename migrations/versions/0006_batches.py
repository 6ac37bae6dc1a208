"""Batch API: files, batches and batch lines (leases, results); the ledger's batch_id and custom_id.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 20:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
LINE_STATES = ("queued", "leased", "succeeded", "failed", "cancelled", "expired")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_files")),
    )
    op.create_index("ix_batch_files_tenant_created_at", "batch_files", ["tenant", "created_at"])
    times = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
             "cancelling_at", "cancelled_at")
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("errors_json", sa.Text(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=True) for name in times),
        sa.CheckConstraint(_one_of("status", BATCH_STATUSES), name=op.f("ck_batches_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_tenant_created_at", "batches", ["tenant", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(_one_of("state", LINE_STATES), name=op.f("ck_batch_lines_state")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches")),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
    )
    op.create_index("ix_batch_lines_state_batch_id", "batch_lines", ["state", "batch_id"])
    op.add_column("usage_ledger", sa.Column("batch_id", sa.String(64), nullable=True))
    op.add_column("usage_ledger", sa.Column("custom_id", sa.String(512), nullable=True))


def downgrade() -> None:
    # In place, never through a table copy (as 0004): a copy of usage_ledger would break recompute_charges' key.
    op.drop_column("usage_ledger", "custom_id")
    op.drop_column("usage_ledger", "batch_id")
    op.drop_index("ix_batch_lines_state_batch_id", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_batch_files_tenant_created_at", table_name="batch_files")
    op.drop_table("batch_files")
