"""Ledger rows opened at admission: status `open`, the owning process, revocation lookups.

A request's row is inserted as `open` when it is admitted, its token counts are
saved as it runs, and it is closed (ok, cancelled, error) when it ends; rows a
dead process left open are closed as `interrupted` (0002's status). `owner` names the process
that holds an open row. The index on api_keys.revoked_at serves the replicas'
check for keys revoked elsewhere.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.sqlite_ledger import rebuild_usage_ledger

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('ok', 'cancelled', 'error', 'rejected', 'interrupted')"
NEW_STATUSES = "status IN ('ok', 'cancelled', 'error', 'rejected', 'interrupted', 'open')"


def _ledger_0002(check: str) -> sa.Table:
    """usage_ledger as 0002 left it, for SQLite's copy (given, not reflected: Alembic may miss its CHECK)."""
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


def _replace_status_check(old: str, new: str, owner: bool) -> None:
    """On SQLite through a copy of the table given as it is (with the owner column or not)."""
    table = _ledger_0002(old)
    if owner:
        table.append_column(sa.Column("owner", sa.String(length=128), nullable=True))

    def change(batch) -> None:
        if owner:
            batch.drop_column("owner")
        batch.drop_constraint(op.f("ck_usage_ledger_status"), type_="check")
        batch.create_check_constraint("status", new)

    rebuild_usage_ledger(change, copy_from=table)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _replace_status_check(OLD_STATUSES, NEW_STATUSES, owner=False)
    else:
        op.drop_constraint(op.f("ck_usage_ledger_status"), "usage_ledger", type_="check")
        op.create_check_constraint("status", "usage_ledger", NEW_STATUSES)
    op.add_column("usage_ledger", sa.Column("owner", sa.String(length=128), nullable=True))
    # Open rows are few at any time; a partial index keeps the search for orphans off the whole ledger.
    op.create_index("ix_usage_ledger_open", "usage_ledger", ["status"], postgresql_where=sa.text("status = 'open'"),
                    sqlite_where=sa.text("status = 'open'"))
    op.create_index("ix_api_keys_revoked_at", "api_keys", ["revoked_at"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_revoked_at", table_name="api_keys")
    op.drop_index("ix_usage_ledger_open", table_name="usage_ledger")
    op.execute("UPDATE usage_ledger SET status = 'interrupted' WHERE status = 'open'")
    if op.get_bind().dialect.name == "sqlite":
        _replace_status_check(NEW_STATUSES, OLD_STATUSES, owner=True)  # drops owner in the same copy
    else:
        op.drop_column("usage_ledger", "owner")
        op.drop_constraint(op.f("ck_usage_ledger_status"), "usage_ledger", type_="check")
        op.create_check_constraint("status", "usage_ledger", OLD_STATUSES)
