"""Issue #31's flood of large bodies: a tenant has at most its concurrency limit of requests being read and
built at once; one more is a 429 before its body is read, with its ledger row, and other tenants are not
counted against it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sqlalchemy import select

from billing.models import UsageEntry


class SlowBody:
    """A request body sent in two parts, the second only once ``go`` is set: a client still uploading."""

    def __init__(self, server) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.model = server.engine.model_name

    def __iter__(self):
        self.started.set()
        yield b'{"model": "' + self.model.encode() + b'", "max_tokens": 2, '
        self.go.wait(30)
        yield b'"messages": [{"role": "user", "content": "hi"}]}'


def _post(server, tenant: str, content=None) -> httpx.Response:
    headers = {"authorization": f"Bearer {server.keys[tenant]}", "content-type": "application/json"}
    if content is None:
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, headers=headers, json={
            "model": server.engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, headers=headers, content=content)


def _statuses(server, tenant: str) -> list[str]:
    with server.db.connect() as c:
        return sorted(c.execute(select(UsageEntry.status).where(UsageEntry.tenant == tenant)).scalars())


@pytest.fixture
def uploading(server):
    """Two of tenant ``slow``'s requests (limit 2 concurrent) whose bodies are half sent; yields their bodies."""
    server.add_tenant("slow", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=2)
    bodies = [SlowBody(server) for _ in range(2)]
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda b=b: answers.append(_post(server, "slow", b))) for b in bodies]
    for t in threads:
        t.start()
    for body in bodies:
        assert body.started.wait(10)
    deadline = time.monotonic() + 10
    while server.gateway.reading_slots.under_way("slow") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield bodies
    for body in bodies:
        body.go.set()
    for t in threads:
        t.join(30)
    assert [a.status_code for a in answers] == [200, 200]


def test_a_request_beyond_the_tenants_limit_of_bodies_being_read_is_a_429_before_its_body_is_read(server, uploading):
    assert server.gateway.reading_slots.under_way("slow") == 2
    refused = _post(server, "slow", content=b"{not even json")  # a body that would be a 400 if it were read
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "being admitted at once: limit 2" in error["message"]
    assert refused.headers["retry-after"]
    deadline = time.monotonic() + 10
    while _statuses(server, "slow") != ["rejected"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _statuses(server, "slow") == ["rejected"]  # its one ledger row
    # Another tenant is not counted against the slow one's slots.
    assert _post(server, "globex").status_code == 200


def test_a_tenants_slots_come_back_once_its_requests_are_admitted(server, uploading):
    for body in uploading:
        body.go.set()
    deadline = time.monotonic() + 30
    while server.gateway.reading_slots.under_way("slow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.gateway.reading_slots.under_way("slow") == 0
    assert _post(server, "slow").status_code == 200


def test_a_refused_body_gives_its_slot_back(server):
    server.add_tenant("one", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=1)
    for _ in range(3):
        r = _post(server, "one", content=b"{not json")
        assert r.status_code == 400, r.text
    assert server.gateway.reading_slots.under_way("one") == 0
    assert _post(server, "one").status_code == 200
