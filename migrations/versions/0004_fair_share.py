"""Fair share: a weight per tenant, and each ledger row's time in the engine's queue.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 17:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    op.add_column("usage_ledger", sa.Column("queue_seconds", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    # In place, never through a table copy: on SQLite (3.35+ drops a column in place) a copy of
    # tenants or usage_ledger would break the foreign keys that point at them.
    op.drop_column("usage_ledger", "queue_seconds")
    op.drop_column("tenants", "weight")
