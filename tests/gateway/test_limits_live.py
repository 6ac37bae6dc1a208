"""Rate limits through the HTTP path: 429s clients understand, and budgets that hold under concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx
import openai
import pytest
from sqlalchemy import text

from gateway.ratelimit import make_limiter

REDIS_URL = "redis://127.0.0.1:6379/0"


def ledger_statuses(server) -> list[str]:
    with server.db.connect() as c:
        return [r[0] for r in c.execute(text("SELECT status FROM usage_ledger ORDER BY id"))]


def test_rate_limited_request_raises_rate_limit_error_with_headers(serve):
    live = serve()
    key = live.add_tenant("tiny", "standard", rpm=1, tpm=10_000, max_concurrent=4)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    client.completions.create(model=live.engine.model_name, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=live.engine.model_name, prompt="a", max_tokens=1)
    err = e.value
    assert err.code == "rate_limit_exceeded" and err.type == "requests"
    h = err.response.headers
    assert int(h["retry-after"]) >= 1
    assert h["x-ratelimit-limit-requests"] == "1" and h["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-tokens" in h and "x-ratelimit-limit-tokens" in h
    deadline = time.monotonic() + 5
    while ledger_statuses(live).count("rejected") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # rejected rows are written in batches
    assert sorted(ledger_statuses(live)) == ["ok", "rejected"]


def test_client_retry_waits_for_retry_after_then_succeeds(serve):
    live = serve(rate_window_s=1.0)  # a one-second "minute" keeps the wait short
    key = live.add_tenant("tiny", "standard", rpm=1, tpm=10_000, max_concurrent=4)
    seen: list[tuple[float, int, str | None]] = []

    def on_response(response: httpx.Response) -> None:
        seen.append((time.monotonic(), response.status_code, response.headers.get("retry-after-ms")))

    def on_request(request: httpx.Request) -> None:
        seen.append((time.monotonic(), 0, None))

    http = httpx.Client(event_hooks={"request": [on_request], "response": [on_response]})
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=3, http_client=http)
    client.completions.create(model=live.engine.model_name, prompt="a", max_tokens=1)
    seen.clear()
    out = client.completions.create(model=live.engine.model_name, prompt="a", max_tokens=1)
    assert out.usage.completion_tokens == 1
    statuses = [s for _, s, _ in seen if s]
    assert statuses[0] == 429 and statuses[-1] == 200
    refused_at, _, retry_ms = next(x for x in seen if x[1] == 429)
    retried_at = next(t for t, s, _ in seen if s == 0 and t > refused_at)
    assert retried_at - refused_at >= 0.9 * int(retry_ms) / 1000


async def _fire(urls: list[str], key: str, model: str, n: int, max_tokens: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as http:
        async def one(i: int) -> int:
            r = await http.post(f"{urls[i % len(urls)]}/v1/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": model, "prompt": "hey", "max_tokens": max_tokens})
            return r.status_code

        return await asyncio.gather(*[one(i) for i in range(n)])


def _servers(serve, backend: str, count: int):
    prefix = f"test:{uuid.uuid4().hex}"
    return [serve(limiter=make_limiter(REDIS_URL if backend == "redis" else None, key_prefix=prefix))
            for _ in range(count)]


@pytest.mark.parametrize("backend, replicas", [("redis", 2), ("memory", 1)])
def test_rpm_holds_under_concurrent_load(serve, backend, replicas):
    servers = _servers(serve, backend, replicas)
    key = servers[0].add_tenant("busy", "standard", rpm=12, tpm=1_000_000, max_concurrent=1000)
    codes = asyncio.run(_fire([s.url for s in servers], key, servers[0].engine.model_name, 40, 1))
    assert codes.count(200) == 12
    assert codes.count(429) == 28


@pytest.mark.parametrize("backend, replicas", [("redis", 2), ("memory", 1)])
def test_tpm_holds_under_concurrent_load(serve, backend, replicas):
    servers = _servers(serve, backend, replicas)
    # Each request reserves 3 prompt tokens + 7 max_tokens = 10, and uses all of them
    # (the tiny model has no end-of-sequence token), so nothing is given back.
    key = servers[0].add_tenant("hungry", "standard", rpm=1000, tpm=95, max_concurrent=1000)
    codes = asyncio.run(_fire([s.url for s in servers], key, servers[0].engine.model_name, 30, 7))
    assert codes.count(200) == 9
    assert codes.count(429) == 21


@contextlib.contextmanager
def beside_a_stream(serve, max_concurrent: int):
    """A tenant limited to ``max_concurrent`` with one long stream open: yields (post, body) for more requests."""
    live = serve()
    key = live.add_tenant("narrow", "standard", rpm=1000, tpm=1_000_000, max_concurrent=max_concurrent)
    body = {"model": live.engine.model_name, "prompt": "x", "max_tokens": 200, "stream": True}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=30) as http, http.stream("POST", live.url + "/v1/completions", json=body,
                                                        headers=headers) as first:
        assert first.status_code == 200
        yield lambda **extra: http.post(live.url + "/v1/completions", json={**body, "stream": False, **extra},
                                        headers=headers)


def test_concurrency_limit_refuses_the_extra_stream(serve):
    with beside_a_stream(serve, max_concurrent=1) as post:
        second = post()
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "rate_limit_exceeded"


def test_concurrency_limit_counts_each_choice_of_a_request(serve):
    """n choices run n sequences: a tenant allowed 3 at once cannot run n=3 beside a stream."""
    with beside_a_stream(serve, max_concurrent=3) as post:
        wide = post(n=3, max_tokens=1)
        assert wide.status_code == 429
        assert "concurrent sequences" in wide.json()["error"]["message"]
        two = post(n=2, max_tokens=1)
        assert two.status_code == 200, two.text


def test_an_unreachable_redis_refuses_with_503_and_retry_after_not_500(serve, unused_port):
    # Fail closed: without the shared budget the limits would stop holding across replicas.
    live = serve(limiter=make_limiter(f"redis://127.0.0.1:{unused_port}/0"))
    key = live.add_tenant("acme", "premium", rpm=100, tpm=100_000, max_concurrent=4)
    r = httpx.post(live.url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": live.engine.model_name, "prompt": "a", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable" and "rate limiter" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 5
    while "rejected" not in ledger_statuses(live) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ledger_statuses(live) == ["rejected"]
    assert sum(live.engine.kv_usage()[0].values()) == 0 and live.gateway.lifecycle.in_flight == 0
