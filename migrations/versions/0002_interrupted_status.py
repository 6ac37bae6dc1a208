"""The ledger's status may be `interrupted`: a request the server ended while stopping (a drain's deadline).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 17:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.sqlite_ledger import rebuild_usage_ledger

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ("ok", "cancelled", "error", "rejected")
AFTER = (*BEFORE, "interrupted")


def _allow(statuses: tuple[str, ...]) -> None:
    def change(batch) -> None:
        batch.drop_constraint(op.f("ck_usage_ledger_status"), type_="check")
        batch.create_check_constraint("status", "status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")")

    if op.get_bind().dialect.name == "sqlite":
        rebuild_usage_ledger(change)  # a plain batch copy fails once the ledger has recompute charges
    else:
        with op.batch_alter_table("usage_ledger") as batch:
            change(batch)


def upgrade() -> None:
    _allow(AFTER)


def downgrade() -> None:
    op.execute("UPDATE usage_ledger SET status = 'cancelled' WHERE status = 'interrupted'")
    _allow(BEFORE)
