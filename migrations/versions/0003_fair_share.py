"""Fair share: a weight per tenant, and each ledger row's time in the engine's queue.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 17:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # batch_alter_table: SQLite cannot drop a column in place, and the downgrade must.
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(sa.Column("queue_seconds", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("queue_seconds")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
