"""The documented PostgreSQL URL is the plain `postgresql://` one, served by psycopg 3."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from billing.db import create_engine_for, upgrade
from billing.ledger import Ledger
from billing.usage_record import UsageRecord

pytestmark = pytest.mark.postgres


def test_a_plain_postgresql_url_migrates_and_takes_ledger_rows(pg_schema, tmp_path):
    url = f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{pg_schema}"
    upgrade(url)
    engine = create_engine_for(url)
    try:
        assert engine.dialect.driver == "psycopg"
        record = UsageRecord("plain-url-1", "acme", "premium", None, "ok", 1.0, 2.0, completion_tokens=3)
        assert Ledger(engine, tmp_path / "spool.jsonl").write(record) is True
        with engine.connect() as c:
            assert c.execute(text("SELECT completion_tokens FROM usage_ledger")).scalar_one() == 3
    finally:
        engine.dispose()


def test_a_psycopg2_url_from_an_older_config_runs_on_psycopg_3(pg_schema):
    engine = create_engine_for(f"postgresql+psycopg2://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{pg_schema}")
    try:
        assert engine.dialect.driver == "psycopg"
        with engine.connect() as c:
            assert c.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()
