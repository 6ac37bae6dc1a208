"""Hostile request bodies found by hand: each is a clean 4xx (or a normal answer), never a 500 or a failed batch."""

from __future__ import annotations

import threading

import httpx
import pytest

ADMIN_TOKEN = "test-admin-token"  # the one conftest.py gives every test server


@pytest.fixture
def send(server):
    def post(path: str, content: bytes, key: str | None = "acme"):
        headers = {"content-type": "application/json"}
        headers["authorization"] = f"Bearer {server.keys[key]}" if key else f"Bearer {ADMIN_TOKEN}"
        return httpx.post(server.url + path, content=content, headers=headers, timeout=60)

    return post


def openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_temperature_and_top_p_that_underflow_float32_are_answered_and_spare_their_neighbours(server):
    model = server.engine.model_name
    auth = {"authorization": f"Bearer {server.keys['acme']}"}
    neighbour: dict = {}

    def run_neighbour():
        neighbour["r"] = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60, json={
            "model": model, "prompt": "a neighbour", "max_tokens": 24, "ignore_eos": True})

    thread = threading.Thread(target=run_neighbour)
    thread.start()
    hostile = [{"temperature": 1e-300}, {"temperature": 1e-46}, {"top_p": 1e-46}, {"temperature": 2, "top_p": 1e-300}]
    for params in hostile:
        r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": model, "prompt": "hello", "max_tokens": 4, **params})
        assert r.status_code == 200, (params, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    thread.join(60)
    assert neighbour["r"].status_code == 200 and neighbour["r"].json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/completions", b'{"model": "m", "prompt": "\\udfff"}'),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x\\ud83dy"}'),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", b'{"model": "MODEL", "stop": ["\\udc00"], "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/chat/completions", b"[" * 20_000 + b"]" * 20_000),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}"),
])
def test_hostile_bodies_get_an_openai_shaped_400(send, server, path, body):
    r = send(path, body.replace(b"MODEL", server.engine.model_name.encode()))
    assert r.status_code == 400, r.text
    openai_error(r)
    assert server.gateway.lifecycle.in_flight == 0


@pytest.mark.parametrize("path, body", [
    ("/admin/tenants", b'{"name": "\\ud800", "tier": "standard"}'),
    ("/admin/tenants", b'{"name": "nul\\u0000name", "tier": "standard"}'),
    ("/admin/tenants", b'{"name": "big", "tier": "standard", "rpm": 9223372036854775808}'),
    ("/admin/tenants", b'{"name": "big", "tier": "standard", "tpm": 2147483648}'),
    ("/admin/tenants", b'{"name": "deep", "tier": "standard", "rpm": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"),
    ("/admin/tenants", b'{"name": "long", "tier": "standard", "rpm": ' + b"7" * 4400 + b"}"),
    ("/admin/adapters", b'{"name": "a", "path": "/tmp/\\u0000x"}'),
    ("/admin/adapters", b'{"name": "\\udfff", "path": "/tmp"}'),
])
def test_hostile_admin_bodies_get_an_openai_shaped_4xx(send, path, body):
    r = send(path, body, key=None)
    assert 400 <= r.status_code < 500, r.text
    openai_error(r)


def test_a_limit_past_the_databases_integers_is_400_on_update_too(send, server):
    r = httpx.patch(server.url + "/admin/tenants/acme", json={"rpm": 2**63}, timeout=30,
                    headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 400 and openai_error(r)["code"] == "invalid_value"
