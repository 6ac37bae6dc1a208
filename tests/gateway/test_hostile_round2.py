"""Issue #31's request-sized costs: tool text counts toward the prompt bound before anything is tokenized,
a response repeats its prompt's scores only as much as one copy would hold, and every refusal after
authentication leaves one ``rejected`` ledger row."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sqlalchemy import select

from billing.models import UsageEntry
from gateway.schemas import MAX_PROMPT_LOGPROBS


def _post(server, path: str, body: dict, tenant: str = "acme") -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, headers={"authorization": f"Bearer {server.keys[tenant]}"},
                      json={"model": server.engine.model_name, **body})


def _rows(server, request_id: str) -> list[tuple]:
    with server.db.connect() as c:
        return c.execute(select(UsageEntry.status, UsageEntry.tenant).where(UsageEntry.request_id == request_id)).all()


def _rows_of(server, tenant: str) -> list[tuple]:
    with server.db.connect() as c:
        return c.execute(select(UsageEntry.status).where(UsageEntry.tenant == tenant)).all()


def _wait_for_rows(server, tenant: str, count: int) -> list[tuple]:
    deadline = time.monotonic() + 10
    while len(_rows_of(server, tenant)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _rows_of(server, tenant)


@pytest.fixture
def templating(server, monkeypatch) -> list[int]:
    """Counts the chat template renderings (each one tokenizes what it renders)."""
    calls: list[int] = []
    tokenizer = server.engine.tokenizer
    render = tokenizer.apply_chat_template

    def counted(*args, **kwargs):
        calls.append(1)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counted)
    return calls


# -- defect 5: tools and the tool-call history count toward the prompt bound ------------------


def test_a_huge_tool_description_is_refused_naming_tools_before_anything_is_rendered(server, templating):
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 900_000}}
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                               "tool_choice": "none", "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["code"] == "context_length_exceeded"
    assert templating == []


def test_huge_tool_call_arguments_in_the_history_are_refused_before_anything_is_rendered(server, templating):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * 900_000})}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and r.json()["error"]["code"] == "context_length_exceeded"
    assert templating == []


def test_small_tools_are_still_rendered_and_counted_in_tokens(server, templating):
    tool = {"type": "function", "function": {"name": "f", "description": "a tool"}}
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                               "tool_choice": "none", "max_tokens": 2})
    assert templating == [1]
    # The tiny model's 256 tokens hold no fallback tool prompt: refused by its token count, once rendered.
    assert r.status_code == 400 and "in the prompt" in r.json()["error"]["message"], r.text


# -- defect 6: prompt scores are in a response once, or the response is bounded ---------------


def test_completions_prompt_scores_times_n_past_one_copys_worth_are_a_400(server):
    prompt = "x" * 200  # the byte tokenizer: 200 tokens
    body = {"prompt": prompt, "max_tokens": 1, "n": 16, "prompt_logprobs": MAX_PROMPT_LOGPROBS}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text[:300]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "n": 16, "echo": True, "logprobs": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text[:300]
    # One copy is always served, however long the prompt and however many alternatives.
    r = _post(server, "/v1/completions", {**body, "n": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 200


def test_chat_answers_the_prompt_scores_once_whatever_n(server):
    messages = [{"role": "user", "content": "y" * 150}]
    one = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 20})
    many = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 20,
                                                  "n": 16})
    assert one.status_code == many.status_code == 200, many.text[:300]
    assert "prompt_logprobs" not in json.dumps(many.json()["choices"])
    # Sixteen one-token choices add far less than a second copy of the scores would.
    assert len(many.content) < 1.5 * len(one.content)


def test_a_large_body_is_encoded_in_slices_to_the_same_bytes_as_starlette_writes():
    from starlette.responses import JSONResponse

    from gateway.response_size import encode_json

    body = {"id": "x", "prompt_logprobs": [None] + [{str(i): {"logprob": -0.5 * i, "rank": i, "decoded_token": "é\u2028"}}
                                                    for i in range(3000)],
            "choices": [{"index": 0, "logprobs": {"content": [{"token": "a", "top_logprobs": []}] * 600}}]}
    assert encode_json(body) == JSONResponse(body).body


# -- defect 10: a refusal after authentication writes one rejected row ------------------------


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400),
])
def test_a_refusal_after_the_key_is_known_writes_one_rejected_row(server, path, body, status):
    tenant = "refused"
    server.add_tenant(tenant, "standard", rpm=1000, tpm=10**9, max_concurrent=100)
    r = _post(server, path, body, tenant=tenant)
    assert r.status_code == status, r.text
    assert _wait_for_rows(server, tenant, 1) == [("rejected",)]
    time.sleep(0.2)
    assert _rows_of(server, tenant) == [("rejected",)]  # exactly one


def test_a_refusal_that_becomes_a_429_still_writes_one_row(server):
    tenant = "flooder"
    server.add_tenant(tenant, "standard", rpm=2, tpm=10**9, max_concurrent=100)
    statuses = [_post(server, "/v1/completions", {"prompt": "", "max_tokens": 1}, tenant=tenant).status_code
                for _ in range(3)]
    assert statuses == [400, 400, 429]
    assert _wait_for_rows(server, tenant, 3) == [("rejected",)] * 3


def test_a_failure_after_the_key_is_known_still_writes_one_row(server, monkeypatch):
    def broken(req):
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(server.gateway.prompts, "check_size", broken)
    tenant = "unlucky"
    server.add_tenant(tenant, "standard", rpm=1000, tpm=10**9, max_concurrent=100)
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, tenant=tenant)
    assert r.status_code == 500
    assert _wait_for_rows(server, tenant, 1) == [("error",)]


ENGINE_ERROR = {"message": "The engine failed while generating; the request was stopped.", "type": "server_error",
                "param": None, "code": "engine_error"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_step_answers_an_engine_error_and_writes_one_error_row(server, monkeypatch, stream):
    real_execute = server.engine.runner.execute_with_hidden
    failures = [RuntimeError("injected kernel failure")]  # the first step fails, the ones after it run

    def failing_once(plan, *args):
        if failures:
            raise failures.pop()
        return real_execute(plan, *args)

    monkeypatch.setattr(server.engine.runner, "execute_with_hidden", failing_once)
    tenant = f"failed-{stream}"
    server.add_tenant(tenant, "standard", rpm=1000, tpm=10**9, max_concurrent=100)
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream}, tenant=tenant)
    if stream:
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1] == {"error": ENGINE_ERROR}
    else:
        assert (r.status_code, r.json()) == (500, {"error": ENGINE_ERROR})
    assert _wait_for_rows(server, tenant, 1) == [("error",)]
