"""API keys: issued once as `tg-<key_id>-<random>`, stored only as a SHA-256 digest, checked in constant time.

A plain SHA-256 (no slow KDF) is enough because the secrets are 256 random bits, not passwords.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.errors import UnknownKey
from billing.models import Adapter, AdapterGrant, ApiKey, Tenant, utcnow
from billing.tenants import find_tenant

PREFIX = "tg"


@dataclass(frozen=True)
class TenantInfo:
    """What the gateway needs to admit a request; `version` changes whenever any of it does."""

    tenant: str
    tier: str
    rpm: int
    tpm: int
    max_concurrent: int
    adapters: frozenset[str]
    version: int
    updated_at: datetime
    key_id: str
    weight: float = 1.0  # fair share inside the tier


def create_key(engine: Engine, tenant: str) -> tuple[str, str]:
    """A new key for `tenant`: returns (key_id, secret); the secret is not kept and cannot be shown again."""
    with Session(engine) as session:
        owner = find_tenant(session, tenant)
        key_id = secrets.token_hex(8)
        secret = f"{PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"
        session.add(ApiKey(key_id=key_id, secret_sha256=_digest(secret), tenant_id=owner.id))
        session.commit()
        return key_id, secret


def revoke_key(engine: Engine, key_id: str) -> None:
    with Session(engine) as session:
        key = session.scalar(select(ApiKey).where(ApiKey.key_id == key_id))
        if key is None:
            raise UnknownKey(f"unknown key id {key_id!r}")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            session.commit()


def authenticate(engine: Engine, secret: str) -> TenantInfo | None:
    """The tenant behind `secret`, or None for a malformed, unknown or revoked key."""
    key_id = parse_key_id(secret)
    if key_id is None:
        return None
    with Session(engine) as session:
        row = session.execute(
            select(ApiKey, Tenant)
            .join(Tenant, ApiKey.tenant_id == Tenant.id)
            .where(ApiKey.key_id == key_id, ApiKey.revoked_at.is_(None))
        ).first()
        if row is None:
            return None
        key, tenant = row
        if not hmac.compare_digest(key.secret_sha256, _digest(secret)):
            return None
        return _tenant_info(session, tenant, key.key_id)


def tenant_info(engine: Engine, name: str) -> TenantInfo | None:
    """The tenant called ``name`` as a key of its would show it (no key id), or None: for work it sent
    earlier and that runs without a key (a batch's lines)."""
    with Session(engine) as session:
        tenant = session.scalar(select(Tenant).where(Tenant.name == name))
        return None if tenant is None else _tenant_info(session, tenant, "")


def _tenant_info(session: Session, tenant: Tenant, key_id: str) -> TenantInfo:
    adapters = session.scalars(
        select(Adapter.name)
        .join(AdapterGrant, AdapterGrant.adapter_id == Adapter.id)
        .where(AdapterGrant.tenant_id == tenant.id)
    )
    return TenantInfo(
        tenant=tenant.name,
        tier=tenant.tier,
        rpm=tenant.rpm,
        tpm=tenant.tpm,
        max_concurrent=tenant.max_concurrent,
        adapters=frozenset(adapters),
        version=tenant.version,
        updated_at=tenant.updated_at,
        key_id=key_id,
        weight=tenant.weight,
    )


def revocation_mark(engine: Engine) -> tuple[datetime | None, int]:
    """Changes whenever a key is revoked: (latest revocation time, number of revoked keys); one indexed read."""
    with engine.connect() as connection:
        latest, count = connection.execute(
            select(func.max(ApiKey.revoked_at), func.count(ApiKey.revoked_at))
        ).one()
    return latest, int(count)


def parse_key_id(secret: str) -> str | None:
    parts = secret.split("-", 2)
    if len(parts) != 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
