"""Migrations: every version applies on SQLite and PostgreSQL, and the models do not drift from them."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from billing.db import alembic_config, create_engine_for, upgrade
from billing.schema import metadata
from billing.tenants import create_tenant, list_tenants


def _alembic(connection):
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    return cfg


def test_models_match_migrated_schema(engine):
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), metadata) == []
        command.check(_alembic(connection))  # raises if autogenerate would emit anything


def test_every_migration_applies_one_by_one_and_back(empty_db_url):
    engine = create_engine_for(empty_db_url)
    revisions = [s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()]
    for revision in reversed(revisions):
        upgrade(empty_db_url, revision)
        with engine.connect() as connection:
            assert MigrationContext.configure(connection).get_current_revision() == revision
    with engine.begin() as connection:
        command.downgrade(_alembic(connection), "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(empty_db_url)
    assert {"tenants", "api_keys", "adapters", "adapter_grants", "usage_ledger"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()


def test_upgrade_twice_is_a_no_op(db_url, engine):
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    create_tenant(engine, "acme", "premium")
    upgrade(db_url)
    with engine.connect() as connection:
        assert MigrationContext.configure(connection).get_current_revision() == head
    assert [t.name for t in list_tenants(engine)] == ["acme"]


def test_default_database_is_a_sqlite_file_under_var_of_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    upgrade(None)
    assert (tmp_path / "var" / "tiergate.db").exists()


def test_billing_takes_its_url_from_the_caller_not_the_environment(tmp_path, monkeypatch):
    # TIERGATE_DATABASE_URL is read once, by the gateway's settings (tests/gateway/test_cli.py).
    monkeypatch.setenv("TIERGATE_DATABASE_URL", "postgresql://elsewhere/db")
    monkeypatch.chdir(tmp_path)
    assert create_engine_for(None).url.get_backend_name() == "sqlite"


@pytest.mark.postgres
def test_postgresql_has_statistics_on_the_report_buckets(pg_url_migrated):
    engine = create_engine_for(pg_url_migrated)
    with engine.connect() as c:
        names = c.scalars(
            text("SELECT stxname FROM pg_statistic_ext WHERE stxnamespace = current_schema()::regnamespace")
        )
        assert "st_usage_ledger_report_buckets" in set(names)
    engine.dispose()
