"""Ledger rows opened at admission: statuses `open` and `interrupted`, the owning process, revocation lookups.

A request's row is inserted as `open` when it is admitted, its token counts are
saved as it runs, and it is closed (ok, cancelled, error) when it ends; rows a
dead process left open are closed as `interrupted`. `owner` names the process
that holds an open row. The index on api_keys.revoked_at serves the replicas'
check for keys revoked elsewhere.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('ok', 'cancelled', 'error', 'rejected')"
NEW_STATUSES = "status IN ('ok', 'cancelled', 'error', 'rejected', 'interrupted', 'open')"


def _ledger_0001(check: str) -> sa.Table:
    """usage_ledger as 0001 made it, for SQLite's copy-and-move (its CHECK is not reflected reliably)."""
    return sa.Table(
        "usage_ledger", sa.MetaData(),
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("adapter", sa.String(length=128), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("recompute_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("queued_at", sa.DateTime(), nullable=False),
        sa.Column("first_token_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint(check, name="ck_usage_ledger_status"),
        sa.UniqueConstraint("request_id", name="uq_usage_ledger_request_id"),
        sa.Index("ix_usage_ledger_finished_at_tier", "finished_at", "tier"),
        sa.Index("ix_usage_ledger_tenant_finished_at", "tenant", "finished_at"),
        sa.Index("ix_usage_ledger_adapter_finished_at", "adapter", "finished_at"),
    )


def _replace_status_check(old: str, new: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        # The copy drops and renames the table recompute_charges points at: check that at commit.
        op.execute("PRAGMA defer_foreign_keys=ON")
        with op.batch_alter_table("usage_ledger", copy_from=_ledger_0001(old), recreate="always") as batch:
            batch.drop_constraint(op.f("ck_usage_ledger_status"), type_="check")
            batch.create_check_constraint("status", new)
    else:
        op.drop_constraint(op.f("ck_usage_ledger_status"), "usage_ledger", type_="check")
        op.create_check_constraint("status", "usage_ledger", new)


def upgrade() -> None:
    _replace_status_check(OLD_STATUSES, NEW_STATUSES)
    op.add_column("usage_ledger", sa.Column("owner", sa.String(length=128), nullable=True))
    # Open rows are few at any time; a partial index keeps the search for orphans off the whole ledger.
    op.create_index("ix_usage_ledger_open", "usage_ledger", ["status"], postgresql_where=sa.text("status = 'open'"),
                    sqlite_where=sa.text("status = 'open'"))
    op.create_index("ix_api_keys_revoked_at", "api_keys", ["revoked_at"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_revoked_at", table_name="api_keys")
    op.drop_index("ix_usage_ledger_open", table_name="usage_ledger")
    op.execute("UPDATE usage_ledger SET status = 'error' WHERE status IN ('open', 'interrupted')")
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("usage_ledger") as batch:
            batch.drop_column("owner")
    else:
        op.drop_column("usage_ledger", "owner")
    _replace_status_check(NEW_STATUSES, OLD_STATUSES)
