"""Tenants: their tier, rate limits, batch queue limit and fair-share weight, created and changed by the admin API
and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.errors import DuplicateTenant, InvalidLimit, InvalidTier, UnknownTenant
from billing.models import DEFAULT_BATCH_QUEUE_TOKENS, Tenant, find_named, utcnow

TIERS = ("premium", "standard", "batch")  # batch: spare capacity only (issue 32)
DEFAULT_RPM = 60
DEFAULT_TPM = 100_000
DEFAULT_MAX_CONCURRENT = 8
LIMITS = ("rpm", "tpm", "max_concurrent", "batch_queue_tokens")
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1000.0  # a weight is a ratio between tenants; beyond this it is surely a typo
MAX_LIMIT = 2**31 - 1  # the limit columns are 32-bit integers in PostgreSQL
# batch_queue_tokens is a 64-bit column (OpenAI's queue limits reach billions); JSON numbers stay exact to 2**53.
MAX_LIMITS = {"batch_queue_tokens": 2**53}


@dataclass(frozen=True)
class TenantSettings:
    name: str
    tier: str
    rpm: int
    tpm: int
    max_concurrent: int
    version: int
    updated_at: datetime
    weight: float = DEFAULT_WEIGHT
    batch_queue_tokens: int = DEFAULT_BATCH_QUEUE_TOKENS


def create_tenant(
    engine: Engine,
    name: str,
    tier: str,
    rpm: int = DEFAULT_RPM,
    tpm: int = DEFAULT_TPM,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    weight: float = DEFAULT_WEIGHT,
    batch_queue_tokens: int = DEFAULT_BATCH_QUEUE_TOKENS,
) -> TenantSettings:
    if not name or len(name) > 128 or not name.isprintable():
        raise InvalidLimit(f"tenant name must be 1 to 128 printable characters, got {name!r}")
    _check_tier(tier)
    limits = {"rpm": rpm, "tpm": tpm, "max_concurrent": max_concurrent, "batch_queue_tokens": batch_queue_tokens}
    for field, value in limits.items():
        _check_limit(field, value)
    _check_weight(weight)
    with Session(engine) as session:
        tenant = Tenant(name=name, tier=tier, weight=float(weight), **limits)
        session.add(tenant)
        try:
            session.commit()
        except IntegrityError:
            raise DuplicateTenant(f"tenant {name!r} already exists") from None
        return _settings(tenant)


def list_tenants(engine: Engine) -> list[TenantSettings]:
    with Session(engine) as session:
        return [_settings(t) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


def get_tenant(engine: Engine, name: str) -> TenantSettings:
    with Session(engine) as session:
        return _settings(find_tenant(session, name))


def set_tenant(engine: Engine, name: str, **changes: str | int) -> TenantSettings:
    """Change a tenant's tier, limits (rpm, tpm, max_concurrent, batch_queue_tokens) and/or weight; bumps its
    version."""
    unknown = set(changes) - {"tier", "weight", *LIMITS}
    if unknown:
        raise InvalidLimit(f"unknown tenant setting(s): {', '.join(sorted(unknown))}")
    if "tier" in changes:
        _check_tier(changes["tier"])
    for field in LIMITS:
        if field in changes:
            _check_limit(field, changes[field])
    if "weight" in changes:
        _check_weight(changes["weight"])
        changes["weight"] = float(changes["weight"])
    with Session(engine) as session:
        tenant = find_tenant(session, name)
        for field, value in changes.items():
            setattr(tenant, field, value)
        touch(tenant)
        session.commit()
        return _settings(tenant)


def find_tenant(session: Session, name: str) -> Tenant:
    return find_named(session, Tenant, name, UnknownTenant)


def touch(tenant: Tenant) -> None:
    """Mark a tenant changed so caches of its settings (and grants) refresh."""
    tenant.version += 1
    tenant.updated_at = utcnow()


def _check_tier(tier: object) -> None:
    if tier not in TIERS:
        raise InvalidTier(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")


def _check_limit(field: str, value: object) -> None:
    most = MAX_LIMITS.get(field, MAX_LIMIT)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
        raise InvalidLimit(f"{field} must be an integer from 1 to {most}, got {value!r}")


def _check_weight(value: object) -> None:
    # Compared, never converted: an int too large for a float must be refused, not overflow.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_WEIGHT:
        raise InvalidLimit(f"weight must be a number in (0, {MAX_WEIGHT:g}], got {value!r}")


def _settings(t: Tenant) -> TenantSettings:
    return TenantSettings(t.name, t.tier, t.rpm, t.tpm, t.max_concurrent, t.version, t.updated_at, t.weight,
                          t.batch_queue_tokens)
