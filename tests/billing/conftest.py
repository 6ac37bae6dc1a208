"""Billing fixtures: every database test runs on SQLite and on the real PostgreSQL (a fresh schema each)."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Engine, create_engine, text

from billing.db import create_engine_for, upgrade
from tests.support.faults import TcpProxy

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_ADMIN_URL = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/test"


def pg_url(schema: str, host: str = PG_HOST, port: int = PG_PORT) -> str:
    return f"postgresql://postgres@{host}:{port}/test?options=-csearch_path%3D{schema}"


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A fresh, uniquely named schema in the `test` database, dropped afterwards."""
    schema = f"tg_billing_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    yield schema
    with admin.connect() as c:
        c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def pg_url_migrated(pg_schema: str) -> str:
    url = pg_url(pg_schema)
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """The URL of an empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'billing.db'}"
    return pg_url(request.getfixturevalue("pg_schema"))


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine_for(db_url)
    yield engine
    engine.dispose()


@dataclass
class Outage:
    """A migrated database plus a way to make it unavailable to `url`'s clients and back."""

    url: str
    cut: Callable[[], None]
    restore: Callable[[], None]


@pytest.fixture
def outage(db_url: str) -> Iterator[Outage]:
    if db_url.startswith("sqlite"):
        # Root ignores file permissions, so take the database away by holding its write lock.
        path = db_url.removeprefix("sqlite:///")
        holder = sqlite3.connect(path, isolation_level=None)

        def lock() -> None:
            holder.execute("BEGIN EXCLUSIVE")

        yield Outage(db_url, lock, lambda: holder.execute("ROLLBACK"))
        holder.close()
        return
    proxy = TcpProxy(PG_HOST, PG_PORT)
    schema = db_url.rsplit("%3D", 1)[1]
    yield Outage(pg_url(schema, "127.0.0.1", proxy.port), proxy.cut, proxy.restore)
    proxy.close()
