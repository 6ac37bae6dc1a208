"""Changing usage_ledger on SQLite, which alters a table's constraints only by copying it (Alembic's batch mode).

The copy drops the old table, and with foreign keys on (billing.db turns them on) that drop
breaks recompute_charges' reference to it as soon as the ledger has charges; the pragma that
would allow it cannot change inside the migration's transaction. So recompute_charges steps
aside for the copy and comes back, rows included.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from alembic import op
from alembic.operations import BatchOperations


def rebuild_usage_ledger(change: Callable[[BatchOperations], None], copy_from: sa.Table | None = None) -> None:
    """Apply `change` to usage_ledger through a copy, keeping recompute_charges and its rows."""
    op.execute("CREATE TEMP TABLE recompute_charges_aside AS SELECT * FROM recompute_charges")
    op.drop_index("ix_recompute_charges_finished_at_charged_tier", table_name="recompute_charges")
    op.drop_table("recompute_charges")
    with op.batch_alter_table("usage_ledger", copy_from=copy_from, recreate="always") as batch:
        change(batch)
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
    op.execute("INSERT INTO recompute_charges SELECT * FROM recompute_charges_aside")
    op.execute("DROP TABLE recompute_charges_aside")
