"""The /admin API: token-guarded tenant, key and report management; changes apply at once."""

from __future__ import annotations

import httpx
import openai
import pytest

ADMIN_TOKEN = "test-admin-token"  # the one conftest.py gives every test server


@pytest.fixture
def admin(server):
    return httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)


def test_admin_needs_the_token(server):
    assert httpx.get(server.url + "/admin/tenants").status_code == 401
    r = httpx.get(server.url + "/admin/tenants", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_create_tenant_and_key_then_call_the_api(admin, server):
    r = admin.post("/admin/tenants", json={"name": "initech", "tier": "standard", "rpm": 5})
    assert r.status_code == 201 and r.json()["rpm"] == 5
    key = admin.post("/admin/tenants/initech/keys").json()["key"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key)
    assert client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=1).usage
    names = [t["name"] for t in admin.get("/admin/tenants").json()["data"]]
    assert "initech" in names


def test_limit_change_applies_without_waiting_for_the_cache(admin, server):
    key = server.add_tenant("flaky", "standard", rpm=100)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=1)
    assert admin.patch("/admin/tenants/flaky", json={"rpm": 1}).status_code == 200
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=1)


def test_the_batch_queue_limit_is_set_by_create_and_patch_with_a_default(admin, server):
    r = admin.post("/admin/tenants", json={"name": "bulk", "tier": "batch"})
    assert r.status_code == 201 and r.json()["batch_queue_tokens"] == 20_000_000
    r = admin.patch("/admin/tenants/bulk", json={"batch_queue_tokens": 3_000_000_000})
    assert r.status_code == 200 and r.json()["batch_queue_tokens"] == 3_000_000_000
    r = admin.post("/admin/tenants", json={"name": "small", "tier": "standard", "batch_queue_tokens": 5000})
    assert r.status_code == 201 and r.json()["batch_queue_tokens"] == 5000


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("post", "/admin/tenants", {"name": "x", "tier": "gold"}, 400),
        ("post", "/admin/tenants", {"name": "acme", "tier": "premium"}, 409),
        ("post", "/admin/tenants", {"tier": "premium"}, 400),
        ("patch", "/admin/tenants/nobody", {"rpm": 3}, 404),
        ("patch", "/admin/tenants/acme", {"rpm": -3}, 400),
        ("patch", "/admin/tenants/acme", {"batch_queue_tokens": 0}, 400),
        ("patch", "/admin/tenants/acme", {"batch_queue_tokens": "lots"}, 400),
        ("post", "/admin/tenants/nobody/keys", None, 404),
        ("delete", "/admin/keys/deadbeef", None, 404),
        ("post", "/admin/adapters", {"name": "x", "path": "/does/not/exist"}, 400),
        ("post", "/admin/adapters/nothing/load", None, 404),
        ("post", "/admin/adapters/nothing/grants", {"tenant": "acme"}, 404),
        ("get", "/admin/reports/usage?from=2026-01-02&to=2026-01-01", None, 400),
        ("get", "/admin/reports/usage?from=soon&to=2026-01-01", None, 400),
        ("get", "/admin/reports/usage?from=2026-01-01&to=2026-01-02&group_by=moon", None, 400),
    ],
)
def test_bad_admin_input_is_a_4xx(admin, method, path, body, status):
    r = admin.request(method.upper(), path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_usage_report_counts_served_requests_by_tier(admin, server):
    from datetime import UTC, datetime, timedelta

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["acme"])
    for _ in range(2):
        client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=2)
    today = datetime.now(UTC).date()
    q = f"from={today}&to={today + timedelta(days=1)}&group_by=tier"
    rows = admin.get(f"/admin/reports/usage?{q}").json()["data"]
    premium = [r for r in rows if r["group"] == "premium"]
    assert premium and premium[0]["requests"] == 2 and premium[0]["completion_tokens"] == 4
    csv = admin.get(f"/admin/reports/usage?{q}&format=csv")
    assert csv.status_code == 200 and csv.text.startswith("bucket,")


def test_health_and_readiness(server):
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/readyz").json() == {"status": "ready"}
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "tiergate_ttft_seconds" in metrics.text
