"""The billing tables as typed SQLAlchemy 2 models; migrations/ must keep the database in step with them.

Times are naive UTC datetimes so SQLite and PostgreSQL bucket them the same way.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

# A tenant's batch queue limit unless set (migrations/versions/0007 gives existing tenants the same).
DEFAULT_BATCH_QUEUE_TOKENS = 20_000_000
# Named constraints keep Alembic's autogenerate and batch (SQLite) migrations deterministic.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# A row is `open` from admission to the request's end, then ok, cancelled or error; a refused
# request's row is `rejected` at once. `interrupted`: the server stopped the request (a drain's
# deadline), or its process died and another closed its open row; the row has the tokens it made.
LEDGER_STATUSES = ("ok", "cancelled", "error", "rejected", "interrupted", "open")

# SQLite only auto-increments an INTEGER PRIMARY KEY, not a BIGINT one.
BigId = BigInteger().with_variant(Integer, "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tier: Mapped[str] = mapped_column(String(32))
    rpm: Mapped[int] = mapped_column(Integer)
    tpm: Mapped[int] = mapped_column(Integer)
    max_concurrent: Mapped[int] = mapped_column(Integer)
    # Its share of its tier's engine time relative to the tier's other tenants (fair share).
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    # OpenAI's batch queue limit: tokens (prompts plus max_tokens) its unfinished batches may hold.
    batch_queue_tokens: Mapped[int] = mapped_column(BigInteger, default=DEFAULT_BATCH_QUEUE_TOKENS,
                                                    server_default=str(DEFAULT_BATCH_QUEUE_TOKENS))
    # Bumped on every change of settings or grants: the gateway's auth cache compares it.
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")
    grants: Mapped[list[AdapterGrant]] = relationship(back_populates="tenant")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), unique=True)  # public part of the secret
    secret_sha256: Mapped[str] = mapped_column(String(64))  # hex digest; the secret itself is never stored
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, index=True)

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


class Adapter(Base):
    __tablename__ = "adapters"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    path: Mapped[str] = mapped_column(String(1024))
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    grants: Mapped[list[AdapterGrant]] = relationship(back_populates="adapter")


class AdapterGrant(Base):
    __tablename__ = "adapter_grants"

    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="grants")
    tenant: Mapped[Tenant] = relationship(back_populates="grants")


class UsageEntry(Base):
    """One row per request: opened at its admission and closed at its end (written once if rejected).

    tenant and adapter are names, not foreign keys: the ledger is an immutable history and a
    row replayed from the spool must never be refused because a tenant or adapter changed since.
    gpu_seconds is this request's own compute; recompute_gpu_seconds is recompute performed for
    it after preemptions, whose cost RecomputeCharge assigns to the preempting tier(s).
    """

    __tablename__ = "usage_ledger"
    __table_args__ = (
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in LEDGER_STATUSES) + ")", name="status"
        ),
        Index("ix_usage_ledger_finished_at_tier", "finished_at", "tier"),
        Index("ix_usage_ledger_tenant_finished_at", "tenant", "finished_at"),
        Index("ix_usage_ledger_adapter_finished_at", "adapter", "finished_at"),
        Index("ix_usage_ledger_open", "status", postgresql_where=text("status = 'open'"),
              sqlite_where=text("status = 'open'")),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant: Mapped[str | None] = mapped_column(String(128))  # None: an engine-internal request
    tier: Mapped[str] = mapped_column(String(32))  # the tenant's tier at the time of the request
    adapter: Mapped[str | None] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    recompute_gpu_seconds: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))
    queued_at: Mapped[datetime] = mapped_column(DateTime)
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime)
    # While open: the time of its last saved progress; closed: when it ended.
    finished_at: Mapped[datetime] = mapped_column(DateTime)
    # Seconds the request waited in the engine's queue (after preemptions too): who waited for whom.
    queue_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    owner: Mapped[str | None] = mapped_column(String(128))  # the process holding an open row
    # A Batch API line's request: its batch and the line's custom_id (tier `batch`); None otherwise.
    batch_id: Mapped[str | None] = mapped_column(String(64))
    custom_id: Mapped[str | None] = mapped_column(String(512))


class RecomputeCharge(Base):
    """Recompute performed for one request, charged to the tier whose request preempted it.

    A separate table because one request can be preempted by requests of several tiers;
    finished_at repeats the ledger row's so per-tier reports need no join with the ledger.
    """

    __tablename__ = "recompute_charges"
    __table_args__ = (Index("ix_recompute_charges_finished_at_charged_tier", "finished_at", "charged_tier"),)

    request_id: Mapped[str] = mapped_column(
        ForeignKey("usage_ledger.request_id"), primary_key=True
    )
    charged_tier: Mapped[str] = mapped_column(String(32), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[datetime] = mapped_column(DateTime)


def find_named(session: Session, model: type[Tenant] | type[Adapter], name: str, unknown: type[Exception]):
    """The tenant or adapter called ``name``; ``unknown`` ("unknown tenant 'x'") if there is none."""
    row = session.scalar(select(model).where(model.name == name))
    if row is None:
        raise unknown(f"unknown {model.__name__.lower()} {name!r}")
    return row


class Price(Base):
    """A tier's prices from ``effective_from`` on (until the tier's next row): a change never reprices the past."""

    __tablename__ = "prices"
    __table_args__ = (Index("ix_prices_tier_effective_from", "tier", "effective_from", unique=True),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tier: Mapped[str] = mapped_column(String(32))
    effective_from: Mapped[datetime] = mapped_column(DateTime)
    per_gpu_second: Mapped[float] = mapped_column(Float)
    per_million_prompt_tokens: Mapped[float] = mapped_column(Float)
    per_million_completion_tokens: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Budget(Base):
    """A tenant's spend limit in one unit over a period (billing.budgets); one per tenant and unit."""

    __tablename__ = "budgets"
    __table_args__ = (
        Index("ix_budgets_tenant_id_unit", "tenant_id", "unit", unique=True),
        CheckConstraint("unit IN ('tokens', 'gpu_seconds', 'usd')", name="unit"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    unit: Mapped[str] = mapped_column(String(16))
    limit: Mapped[float] = mapped_column(Float)
    period: Mapped[str] = mapped_column(String(16))  # "month" or "<N>d"
    timezone: Mapped[str] = mapped_column(String(64))
    soft: Mapped[float] = mapped_column(Float)  # fraction of the limit that warns
    # An N-day period runs from this moment's day (in the budget's time zone) on, N days at a time.
    anchored_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

