"""Alembic environment: billing's models are the target; the connection comes from billing.db or the URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from billing.db import create_engine_for
from billing.schema import metadata

config = context.config
target_metadata = metadata


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite can only ALTER through copy-and-move; batch mode makes later migrations portable.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
elif (connection := config.attributes.get("connection")) is not None:
    run_migrations(connection)
else:
    engine = create_engine_for(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as conn:
            run_migrations(conn)
    finally:
        engine.dispose()
