"""Bad input over HTTP: the right status and OpenAI-shaped body, and nothing reaches the engine."""

from __future__ import annotations

import httpx
import pytest

from scheduler.load import TierLoad


@pytest.fixture
def post(server):
    def send(path: str, body=None, content: bytes | None = None, key: str | None = "acme", headers=None):
        h = {"content-type": "application/json", **(headers or {})}
        if key:
            h["authorization"] = f"Bearer {server.keys[key]}"
        return httpx.post(server.url + path, json=body if content is None else None, content=content, headers=h,
                          timeout=30)

    return send


def error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_json_is_400(post):
    r = post("/v1/chat/completions", content=b'{"model": ')
    assert r.status_code == 400 and error(r)["code"] == "invalid_json"


def test_body_over_the_limit_is_413(post):
    r = post("/v1/completions", content=b'{"prompt": "' + b"x" * (1 << 20) + b'"}')
    assert r.status_code == 413


def test_n_past_the_limit_and_best_of_are_400s_that_say_so(post, server):
    r = post("/v1/chat/completions", {"model": server.engine.model_name, "n": 17,
                                      "messages": [{"role": "user", "content": "x"}]})
    e = error(r)
    assert r.status_code == 400 and e["param"] == "n" and "between 1 and 16" in e["message"]
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "x", "best_of": 2})
    assert r.status_code == 400 and error(r)["param"] == "best_of" and "not supported" in error(r)["message"]


def test_wrong_type_names_the_parameter(post, server):
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "x", "temperature": "warm"})
    assert r.status_code == 400 and error(r)["param"] == "temperature"


def test_prompt_plus_max_tokens_over_the_context_is_context_length_exceeded(post, server):
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "x" * 200, "max_tokens": 100})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "y" * 300})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary_are_400(post, server):
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": [1, 2, 10_000]})
    assert r.status_code == 400 and error(r)["param"] == "prompt"


def test_missing_key_is_401(post, server):
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "x"}, key=None)
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"


def test_unknown_route_and_wrong_method_are_openai_shaped(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and error(r)["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405


def test_predicted_ttft_over_slo_is_429_overloaded_with_retry_after(post, server, monkeypatch):
    overloaded = {"premium": TierLoad(3, 8, 4.0), "standard": TierLoad(20, 8, 40.0)}
    monkeypatch.setattr(server.engine, "load", lambda: overloaded)
    r = post("/v1/completions", {"model": server.engine.model_name, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 429
    assert error(r)["code"] == "overloaded" and int(r.headers["retry-after"]) >= 3
    text = httpx.get(server.url + "/metrics").text
    assert 'tiergate_rejections_total{reason="slo",tier="premium"} 1.0' in text


def test_bad_inputs_leave_the_engine_untouched(post, server):
    post("/v1/completions", content=b"nope")
    post("/v1/completions", {"model": server.engine.model_name, "prompt": "x", "n": 17})
    post("/v1/completions", {"model": server.engine.model_name, "prompt": "x" * 400})
    assert server.gateway.lifecycle.in_flight == 0
    assert sum(server.engine.kv_usage()[0].values()) == 0
