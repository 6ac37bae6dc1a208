"""A ``database_url`` fixture on SQLite and on the real PostgreSQL (a fresh schema each), for gateway tests whose
behaviour lives in the database: a test module imports it to override the gateway fixtures' SQLite-only one."""

from __future__ import annotations

import pytest

from billing.db import upgrade
from tests.cluster.cluster import create_schema, drop_schema, schema_url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tiergate.db'}"
        upgrade(url)
        yield url
        return
    schema = create_schema()
    url = schema_url(schema)
    upgrade(url)
    try:
        yield url
    finally:
        drop_schema(schema)
