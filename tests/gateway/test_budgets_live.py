"""Budgets through the HTTP path: OpenAI's insufficient_quota, changes that reach every replica, /v1/usage
agreeing with the report to the cent, soft-threshold warnings, and the admin API's answers to bad input."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import openai
import pytest

from billing.models import utcnow
from billing.prices import LEAD_S, set_price
from tests.gateway.conftest import ADMIN_TOKEN

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def complete(live, key: str, max_tokens: int = 7, prompt: str = "hey") -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", headers=bearer(key), timeout=60,
                      json={"model": live.engine.model_name, "prompt": prompt, "max_tokens": max_tokens})


def test_past_the_budget_openai_clients_get_insufficient_quota_and_do_not_retry(serve):
    live = serve()
    key = live.add_tenant("thrifty", "standard", rpm=1000, tpm=1_000_000, max_concurrent=10)
    assert httpx.put(f"{live.url}/admin/tenants/thrifty/budget", headers=ADMIN, json={"tokens": 25}).status_code == 200
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=3)
    for _ in range(2):
        client.completions.create(model=live.engine.model_name, prompt="hey", max_tokens=7)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=live.engine.model_name, prompt="hey", max_tokens=7)
    err = e.value
    assert err.code == "insufficient_quota" and err.type == "insufficient_quota"
    assert err.response.headers["x-should-retry"] == "false"
    first_of_next_month = (utcnow().replace(day=1) + timedelta(days=32)).replace(day=1, hour=0, minute=0, second=0,
                                                                                  microsecond=0)
    assert err.response.headers["x-budget-reset"] == first_of_next_month.isoformat() + "Z"
    assert "25 tokens per calendar month (UTC), 20 spent" in err.message
    # A request that fits what is left still passes: 20 + 3 + 2 = 25.
    assert client.completions.create(model=live.engine.model_name, prompt="hey", max_tokens=2).usage.total_tokens == 5


def test_a_budget_set_through_one_replica_holds_on_another_within_seconds(serve):
    a, b = serve(budget_poll_s=0.2), serve(budget_poll_s=0.2)
    key = a.add_tenant("acme", "premium", rpm=10_000, tpm=10_000_000, max_concurrent=100)
    assert complete(b, key).status_code == 200
    r = httpx.put(f"{a.url}/admin/tenants/acme/budget", headers=ADMIN, json={"tokens": 15, "soft": 0.5})
    assert r.status_code == 200 and (r.json()["unit"], r.json()["limit"]) == ("tokens", 15.0)
    deadline = time.monotonic() + 5
    while complete(b, key).status_code == 200:  # already 10 of 15 spent: the next one cannot fit
        assert time.monotonic() < deadline, "replica b never enforced the budget set through replica a"
        time.sleep(0.1)
    assert httpx.delete(f"{a.url}/admin/tenants/acme/budget?unit=tokens", headers=ADMIN).status_code == 204
    deadline = time.monotonic() + 5
    while complete(b, key).status_code != 200:
        assert time.monotonic() < deadline, "replica b kept a budget deleted through replica a"
        time.sleep(0.1)


def test_usage_endpoint_agrees_with_the_report_to_the_cent(serve):
    live = serve()
    key = live.add_tenant("payer", "premium", rpm=10_000, tpm=10_000_000, max_concurrent=100)
    other = live.add_tenant("neighbour", "premium", rpm=10_000, tpm=10_000_000, max_concurrent=100)
    # Dear prices, so that the tiny model's usage is worth cents: a change half way through.
    set_price(live.db, "premium", 500.0, 3000.0, 7000.0, effective_from=utcnow() - timedelta(days=1), allow_past=True)
    for tenant, budget in [("payer", {"usd": 1000.0}), ("neighbour", {"tokens": 1000})]:
        assert httpx.put(f"{live.url}/admin/tenants/{tenant}/budget", headers=ADMIN, json=budget).status_code == 200
    for i in range(4):
        assert complete(live, key, max_tokens=3 + i).status_code == 200
    set_price(live.db, "premium", 900.0, 5000.0, 11000.0, effective_from=utcnow(), allow_past=True)
    for i in range(3):
        assert complete(live, key, max_tokens=5 + i, prompt="hello").status_code == 200
    assert complete(live, other).status_code == 200
    usage = httpx.get(f"{live.url}/v1/usage", headers=bearer(key)).json()
    assert usage["tenant"] == "payer" and [b["unit"] for b in usage["budgets"]] == ["usd"]  # only its own
    (budget,) = usage["budgets"]
    report = httpx.get(f"{live.url}/admin/reports/usage", headers=ADMIN, params={
        "from": budget["period_start"].removesuffix("Z"), "to": budget["period_end"].removesuffix("Z"),
        "group_by": "tenant", "bucket": "day"}).json()["data"]
    by_day = {row["bucket"][:10]: row["usd"] for row in report if row["group"] == "payer"}
    assert budget["spent"] > 0.01
    assert round(budget["spent"], 2) == round(sum(by_day.values()), 2)
    assert {d["date"]: round(d["spent"], 2) for d in budget["days"] if d["spent"]} == \
        {day: round(usd, 2) for day, usd in by_day.items()}
    assert round(budget["left"], 2) == round(1000.0 - budget["spent"], 2) and budget["reserved"] == 0
    assert httpx.get(f"{live.url}/v1/usage", headers=bearer(other)).json()["budgets"][0]["spent"] == 10


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).received.append(json.loads(body))
        self.send_response(200 if len(type(self).received) > 1 else 503)  # the first try fails: retried
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_the_soft_threshold_warns_once_by_log_metric_and_a_retried_webhook(serve, unused_port, caplog):
    receiver = HTTPServer(("127.0.0.1", unused_port), _Receiver)
    _Receiver.received = []
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        live = serve(budget_webhook_url=f"http://127.0.0.1:{unused_port}/hook")
        key = live.add_tenant("watched", "standard", rpm=10_000, tpm=10_000_000, max_concurrent=100)
        assert httpx.put(f"{live.url}/admin/tenants/watched/budget", headers=ADMIN,
                         json={"tokens": 100, "soft": 0.25}).status_code == 200
        for _ in range(5):  # 10 tokens each: past 25 at the third
            assert complete(live, key).status_code == 200
        deadline = time.monotonic() + 10
        while len(_Receiver.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(_Receiver.received) == 2  # one warning, delivered on its second try
        warning = _Receiver.received[-1]
        assert (warning["event"], warning["tenant"], warning["unit"], warning["spent"], warning["limit"]) == \
            ("budget.soft_threshold", "watched", "tokens", 30, 100)
        assert sum("soft threshold" in r.getMessage() for r in caplog.records) == 1
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'tiergate_budget_spent_ratio{tenant="watched",unit="tokens"} 0.5' in metrics
        assert 'tiergate_budget_soft_threshold_crossings_total{unit="tokens"} 1.0' in metrics
    finally:
        receiver.shutdown()


@pytest.mark.parametrize("method, path, body, status, param", [
    ("PUT", "/admin/tenants/acme/budget", {"tokens": 10, "usd": 1}, 400, "limit"),
    ("PUT", "/admin/tenants/acme/budget", {"tokens": 10, "cap": 1}, 400, "cap"),
    ("PUT", "/admin/tenants/acme/budget", {"tokens": -1}, 400, None),
    ("PUT", "/admin/tenants/acme/budget", {"usd": 5, "period": "fortnight"}, 400, None),
    ("PUT", "/admin/tenants/nobody/budget", {"tokens": 10}, 404, None),
    ("GET", "/admin/tenants/nobody/budget", None, 404, None),
    ("DELETE", "/admin/tenants/acme/budget?unit=bytes", None, 400, "unit"),
    ("DELETE", "/admin/tenants/acme/budget?unit=usd", None, 404, None),
    ("PUT", "/admin/prices/gold", {"per_gpu_second": 1, "per_million_prompt_tokens": 1,
                                   "per_million_completion_tokens": 1}, 400, None),
    ("PUT", "/admin/prices/premium", {"per_gpu_second": 1}, 400, "per_million_prompt_tokens"),
    ("PUT", "/admin/prices/premium", {"per_gpu_second": 1, "per_million_prompt_tokens": 1,
                                      "per_million_completion_tokens": 1, "effective_from": "yesterday"}, 400,
     "effective_from"),
])
def test_admin_budget_and_price_routes_refuse_bad_input_clearly(server, method, path, body, status, param):
    r = httpx.request(method, server.url + path, headers=ADMIN, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_admin_routes_set_and_read_budgets_and_prices(server):
    later = (utcnow() + timedelta(days=3)).replace(microsecond=0)
    r = httpx.put(f"{server.url}/admin/prices/standard", headers=ADMIN, json={
        "per_gpu_second": 0.5, "per_million_prompt_tokens": 1, "per_million_completion_tokens": 2})
    assert r.status_code == 200 and r.json()["per_gpu_second"] == 0.5
    assert httpx.put(f"{server.url}/admin/prices/standard", headers=ADMIN, json={
        "per_gpu_second": 9, "per_million_prompt_tokens": 9, "per_million_completion_tokens": 9,
        "effective_from": later.isoformat()}).status_code == 200
    prices = httpx.get(f"{server.url}/admin/prices", headers=ADMIN).json()["data"]
    assert [(p["tier"], p["per_gpu_second"]) for p in prices] == [("standard", 0.5), ("standard", 9)]
    first = datetime.fromisoformat(prices[0]["effective_from"].removesuffix("Z"))
    assert timedelta(0) < first - utcnow() <= timedelta(seconds=LEAD_S)  # every replica knows it in time
    r = httpx.put(f"{server.url}/admin/tenants/globex/budget", headers=ADMIN,
                  json={"gpu_seconds": 3600, "period": "7d", "timezone": "America/New_York"})
    assert r.status_code == 200
    got = httpx.get(f"{server.url}/admin/tenants/globex/budget", headers=ADMIN).json()
    (budget,) = got["budgets"]
    assert (budget["unit"], budget["limit"], budget["period"], budget["timezone"]) == \
        ("gpu_seconds", 3600, "7d", "America/New_York")
    assert len(budget["days"]) == 7 and budget["period_start"].endswith(("04:00:00Z", "05:00:00Z"))
    listed = httpx.get(f"{server.url}/admin/budgets", headers=ADMIN).json()["data"]
    assert [(b["tenant"], b["unit"]) for b in listed] == [("globex", "gpu_seconds")]
