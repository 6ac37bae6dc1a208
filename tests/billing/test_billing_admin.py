"""Tenants, API keys and adapter grants through billing's admin API."""

from __future__ import annotations

import pytest

from billing import adapters, keys, tenants
from billing.errors import (
    DuplicateAdapter,
    DuplicateTenant,
    InvalidAdapter,
    InvalidLimit,
    InvalidTier,
    UnknownAdapter,
    UnknownGrant,
    UnknownKey,
    UnknownTenant,
)


def test_created_tenants_are_listed_by_name(engine):
    tenants.create_tenant(engine, "zeta", "standard")
    tenants.create_tenant(engine, "acme", "premium", rpm=10, tpm=2000, max_concurrent=2)
    listed = tenants.list_tenants(engine)
    assert [(t.name, t.tier, t.rpm, t.tpm, t.max_concurrent) for t in listed] == [
        ("acme", "premium", 10, 2000, 2),
        ("zeta", "standard", tenants.DEFAULT_RPM, tenants.DEFAULT_TPM, tenants.DEFAULT_MAX_CONCURRENT),
    ]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"tier": "gold"}, InvalidTier),
        ({"rpm": 0}, InvalidLimit),
        ({"tpm": -5}, InvalidLimit),
        ({"max_concurrent": "3"}, InvalidLimit),
        ({"rpm": 2**31}, InvalidLimit),  # past PostgreSQL's integer column
        ({"tpm": 2**63}, InvalidLimit),
        ({"name": "nul\x00byte"}, InvalidLimit),  # PostgreSQL text cannot hold NUL
        ({"name": "lone\ud800surrogate"}, InvalidLimit),
        ({"name": "line\nbreak"}, InvalidLimit),
    ],
)
def test_bad_tenant_settings_are_refused_with_one_line(engine, kwargs, error):
    with pytest.raises(error) as raised:
        tenants.create_tenant(engine, **{"name": "acme", "tier": "standard", **kwargs})
    assert "\n" not in str(raised.value)
    assert tenants.list_tenants(engine) == []


def test_duplicate_tenant_is_refused(engine):
    tenants.create_tenant(engine, "acme", "standard")
    with pytest.raises(DuplicateTenant, match="acme"):
        tenants.create_tenant(engine, "acme", "premium")


def test_set_tenant_changes_settings_and_bumps_version(engine):
    before = tenants.create_tenant(engine, "acme", "standard")
    after = tenants.set_tenant(engine, "acme", tier="premium", rpm=500)
    assert (after.tier, after.rpm, after.tpm) == ("premium", 500, before.tpm)
    assert after.version == before.version + 1 and after.updated_at >= before.updated_at
    with pytest.raises(UnknownTenant):
        tenants.set_tenant(engine, "nobody", rpm=1)
    with pytest.raises(InvalidLimit, match="colour"):
        tenants.set_tenant(engine, "acme", colour="red")


def test_key_authenticates_its_tenant_with_limits_and_grants(engine):
    tenants.create_tenant(engine, "acme", "premium", rpm=7, tpm=700, max_concurrent=3)
    adapters.register_adapter(engine, "sql", "/adapters/sql", "smollm2", 8)
    adapters.grant(engine, "sql", "acme")
    key_id, secret = keys.create_key(engine, "acme")
    assert secret.startswith(f"tg-{key_id}-")
    info = keys.authenticate(engine, secret)
    assert (info.tenant, info.tier, info.rpm, info.tpm, info.max_concurrent) == ("acme", "premium", 7, 700, 3)
    assert info.adapters == {"sql"} and info.key_id == key_id


def test_secret_is_stored_only_as_a_hash(engine):
    from sqlalchemy import text

    tenants.create_tenant(engine, "acme", "standard")
    _, secret = keys.create_key(engine, "acme")
    with engine.connect() as c:
        stored = c.execute(text("SELECT key_id, secret_sha256 FROM api_keys")).one()
    assert secret not in stored and secret.split("-", 2)[2] not in "".join(stored)


@pytest.mark.parametrize(
    "mangle", [lambda s: s[:-1] + ("A" if s[-1] != "A" else "B"), lambda s: "tg-nokey-xyz", lambda s: "", lambda s: "sk-abc"]
)
def test_wrong_or_malformed_secret_authenticates_nobody(engine, mangle):
    tenants.create_tenant(engine, "acme", "standard")
    _, secret = keys.create_key(engine, "acme")
    assert keys.authenticate(engine, mangle(secret)) is None


def test_revoked_key_no_longer_authenticates(engine):
    tenants.create_tenant(engine, "acme", "standard")
    key_id, secret = keys.create_key(engine, "acme")
    _, other = keys.create_key(engine, "acme")
    keys.revoke_key(engine, key_id)
    assert keys.authenticate(engine, secret) is None
    assert keys.authenticate(engine, other).tenant == "acme"
    with pytest.raises(UnknownKey):
        keys.revoke_key(engine, "missing")


def test_key_for_unknown_tenant_is_refused(engine):
    with pytest.raises(UnknownTenant, match="ghost"):
        keys.create_key(engine, "ghost")


def test_grants_change_what_a_key_may_use_and_its_version(engine):
    tenants.create_tenant(engine, "acme", "standard")
    tenants.create_tenant(engine, "beta", "standard")
    adapters.register_adapter(engine, "sql", "/a/sql", "smollm2", 8)
    adapters.register_adapter(engine, "poet", "/a/poet", "smollm2", 16)
    _, secret = keys.create_key(engine, "acme")
    v0 = keys.authenticate(engine, secret).version
    adapters.grant(engine, "sql", "acme")
    adapters.grant(engine, "sql", "acme")  # a second grant is a no-op
    adapters.grant(engine, "poet", "beta")
    granted = keys.authenticate(engine, secret)
    assert granted.adapters == {"sql"} and granted.version == v0 + 1
    assert [(a.name, a.rank, a.tenants) for a in adapters.list_adapters(engine)] == [
        ("poet", 16, ("beta",)),
        ("sql", 8, ("acme",)),
    ]
    adapters.revoke_grant(engine, "sql", "acme")
    revoked = keys.authenticate(engine, secret)
    assert revoked.adapters == frozenset() and revoked.version == v0 + 2
    with pytest.raises(UnknownGrant):
        adapters.revoke_grant(engine, "sql", "acme")


def test_adapter_errors(engine):
    tenants.create_tenant(engine, "acme", "standard")
    adapters.register_adapter(engine, "sql", "/a/sql", "smollm2", 8)
    with pytest.raises(DuplicateAdapter):
        adapters.register_adapter(engine, "sql", "/b", "smollm2", 8)
    with pytest.raises(InvalidAdapter):
        adapters.register_adapter(engine, "bad", "/b", "smollm2", 0)
    with pytest.raises(UnknownAdapter):
        adapters.grant(engine, "nope", "acme")
    with pytest.raises(UnknownTenant):
        adapters.grant(engine, "sql", "nobody")
