"""A ``database_url`` fixture on SQLite and on the real PostgreSQL (a fresh schema each), for gateway tests whose
behaviour lives in the database: a test module imports it to override the gateway fixtures' SQLite-only one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from billing.db import upgrade
from tests.cluster.cluster import create_schema, drop_schema, schema_url


@contextmanager
def migrated_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of a migrated database of ``kind`` (``sqlite``: a file under tmp_path; ``postgresql``: a fresh
    schema, dropped afterwards)."""
    if kind == "sqlite":
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


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    with migrated_database(request.param, tmp_path) as url:
        yield url
