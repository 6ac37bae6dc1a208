"""Database connection and schema upgrades: the default URL, engines per dialect, Alembic run from code.

The URL comes from the caller (the gateway's settings read TIERGATE_DATABASE_URL); unset, a SQLite file."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError

DEFAULT_SQLITE_PATH = Path("var") / "tiergate.db"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# What a database that is down, restarting or locked raises; anything else is a bug and propagates.
UNAVAILABLE = (OperationalError, InterfaceError)
# Where billing's tables live when no URL is given: a SQLite file under ./var (created on first use).
DEFAULT_DATABASE_URL = f"sqlite:///{DEFAULT_SQLITE_PATH}"


def create_engine_for(url: str | None = None, *, connect_timeout_s: float = 5.0) -> Engine:
    """An engine for `url` (DEFAULT_DATABASE_URL if None) that survives the server going away.

    pool_pre_ping drops connections a restarted server closed; the connect timeout bounds how
    long a write waits before the ledger falls back to its spool.
    """
    parsed = make_url(url or DEFAULT_DATABASE_URL)
    if parsed.drivername == "postgresql+psycopg2":
        # psycopg 3 is the driver we ship; an older config naming psycopg2 keeps working on it.
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": connect_timeout_s})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {}
    if parsed.get_backend_name() == "postgresql":
        connect_args["connect_timeout"] = max(1, round(connect_timeout_s))
    return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets reports read while the ledger writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    # In WAL mode NORMAL syncs at checkpoints, not at every commit: a committed row
    # survives a killed process (the ledger's promise), only a power cut can drop
    # the last commits, and each response stops paying a disk flush.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def alembic_config() -> Config:
    """Alembic's config for the packaged migrations, usable from any working directory."""
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Apply every migration up to `revision` to the database at `url`."""
    engine = create_engine_for(url)
    try:
        with engine.begin() as connection:
            cfg = alembic_config()
            # Passing the connection (not the URL) keeps '%' in URLs away from configparser.
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()
