"""Budgets and prices: a tier's prices with the date they take effect, and tenants' spend limits per period.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 17:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("effective_from", sa.DateTime(), nullable=False),
        sa.Column("per_gpu_second", sa.Float(), nullable=False),
        sa.Column("per_million_prompt_tokens", sa.Float(), nullable=False),
        sa.Column("per_million_completion_tokens", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
    )
    op.create_index("ix_prices_tier_effective_from", "prices", ["tier", "effective_from"], unique=True)
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("unit", sa.String(16), nullable=False),
        sa.Column("limit", sa.Float(), nullable=False),
        sa.Column("period", sa.String(16), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("soft", sa.Float(), nullable=False),
        sa.Column("anchored_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("unit IN ('tokens', 'gpu_seconds', 'usd')", name=op.f("ck_budgets_unit")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_budgets_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budgets")),
    )
    op.create_index("ix_budgets_tenant_id_unit", "budgets", ["tenant_id", "unit"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_budgets_tenant_id_unit", table_name="budgets")
    op.drop_table("budgets")
    op.drop_index("ix_prices_tier_effective_from", table_name="prices")
    op.drop_table("prices")
