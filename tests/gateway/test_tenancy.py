"""Tenants sharing one engine: the prefix cache is scoped per tenant, and each request carries its tenant in."""

from __future__ import annotations

import httpx
import pytest

from gateway.settings import SettingsError, load_settings

# Long enough for several full 16-token KV blocks under the byte tokenizer.
SECRET_PROMPT = "alice's quarterly numbers, not for anyone else: revenue 4.2M, churn 3.1%, runway 19 months."


def cached_tokens(server, tenant: str, prompt: str = SECRET_PROMPT) -> tuple[int, int]:
    """(cached, prompt) tokens of a greedy completion of ``prompt`` sent by ``tenant``."""
    r = httpx.post(f"{server.url}/v1/completions", headers={"authorization": f"Bearer {server.keys[tenant]}"},
                   json={"model": server.engine.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


@pytest.fixture
def two_tenants(serve, make_engine):
    def start(**engine_overrides):
        live = serve(engine=make_engine(**engine_overrides))
        for name in ("alice", "bob"):
            live.add_tenant(name, "standard", rpm=10_000, tpm=10_000_000, max_concurrent=100)
        return live

    return start


def test_a_tenant_never_sees_another_tenants_cached_prompt(two_tenants):
    server = two_tenants()
    first, prompt_tokens = cached_tokens(server, "alice")
    assert first == 0 and prompt_tokens > 64
    assert cached_tokens(server, "bob")[0] == 0  # replaying alice's exact prompt reveals nothing
    assert cached_tokens(server, "alice")[0] >= 64  # alice's own replay still hits


def test_shared_scope_lets_tenants_share_cached_prefixes(two_tenants):
    server = two_tenants(prefix_cache_scope="shared")
    cached_tokens(server, "alice")
    assert cached_tokens(server, "bob")[0] >= 64


def test_prefix_cache_scope_setting_is_checked():
    assert load_settings(environ={"TIERGATE_PREFIX_CACHE_SCOPE": "shared"}).prefix_cache_scope == "shared"
    assert load_settings(environ={}).prefix_cache_scope == "tenant"
    with pytest.raises(SettingsError, match="prefix cache scope"):
        load_settings(environ={"TIERGATE_PREFIX_CACHE_SCOPE": "global"})


def test_requests_carry_their_tenant_and_weight_into_the_engine(two_tenants):
    server = two_tenants()
    from billing import tenants as billing_tenants

    billing_tenants.set_tenant(server.db, "bob", weight=3.0)
    seen = []
    submit = server.engine.submit
    server.engine.submit = lambda request: seen.append(request) or submit(request)
    cached_tokens(server, "bob", "hello")
    assert [(r.tenant, r.tenant_weight, r.tier) for r in seen] == [("bob", 3.0, "standard")]
