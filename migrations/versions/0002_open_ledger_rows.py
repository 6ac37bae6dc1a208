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


def _recompute_charges() -> None:
    op.create_table(
        "recompute_charges",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("charged_tier", sa.String(length=32), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["request_id"], ["usage_ledger.request_id"],
                                name=op.f("fk_recompute_charges_request_id_usage_ledger")),
        sa.PrimaryKeyConstraint("request_id", "charged_tier", name=op.f("pk_recompute_charges")),
    )
    op.create_index("ix_recompute_charges_finished_at_charged_tier", "recompute_charges",
                    ["finished_at", "charged_tier"])


def _rebuild_ledger_on_sqlite(copy_from: sa.Table, new_check: str, drop_owner: bool) -> None:
    # SQLite changes a CHECK only by copying the table, and the drop of the old copy would break
    # recompute_charges' foreign key (it cannot be switched off inside a transaction): that
    # table steps aside for the copy and comes back with its rows.
    op.execute("CREATE TEMP TABLE recompute_charges_0002 AS SELECT * FROM recompute_charges")
    op.drop_index("ix_recompute_charges_finished_at_charged_tier", table_name="recompute_charges")
    op.drop_table("recompute_charges")
    with op.batch_alter_table("usage_ledger", copy_from=copy_from, recreate="always") as batch:
        if drop_owner:
            batch.drop_column("owner")
        batch.drop_constraint(op.f("ck_usage_ledger_status"), type_="check")
        batch.create_check_constraint("status", new_check)
    _recompute_charges()
    op.execute("INSERT INTO recompute_charges SELECT * FROM recompute_charges_0002")
    op.execute("DROP TABLE recompute_charges_0002")


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_ledger_on_sqlite(_ledger_0001(OLD_STATUSES), NEW_STATUSES, drop_owner=False)
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
    op.execute("UPDATE usage_ledger SET status = 'error' WHERE status IN ('open', 'interrupted')")
    if op.get_bind().dialect.name == "sqlite":
        ledger = _ledger_0001(NEW_STATUSES)
        ledger.append_column(sa.Column("owner", sa.String(length=128), nullable=True))
        _rebuild_ledger_on_sqlite(ledger, OLD_STATUSES, drop_owner=True)
    else:
        op.drop_column("usage_ledger", "owner")
        op.drop_constraint(op.f("ck_usage_ledger_status"), "usage_ledger", type_="check")
        op.create_check_constraint("status", "usage_ledger", OLD_STATUSES)
