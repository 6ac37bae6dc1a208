"""Issue #31's grammar defects over HTTP: compiles counted against the sender's own limits and bounded in
time and size, and a grammar too slow for its step budget ending its request with a 400 naming the parameter.

The model is the tiny random Llama with the 256-byte tokenizer; the slow grammars are real ones (a
small schema with long counted repetitions in string patterns), cut by the compile budget.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from sqlalchemy import select

from billing.models import UsageEntry
from engine import grammar_probe

COMPILE_BUDGET_S = 6.0
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
AMBIGUOUS_EBNF = 'root ::= y{2000} "z"\ny ::= x "a"\nx ::= x x | "a" | ""'


def slow_schema(tag: str) -> dict:
    """A few kilobytes, and about a second of compile per property on a quiet box: 40 of them keep it far past
    the budget on any machine; ``tag`` makes each one a new grammar."""
    props = {f"{tag}{i}": {"type": "string", "pattern": "^(a|b){1,2000}c{1,50}$"} for i in range(40)}
    return {"type": "object", "properties": props, "required": list(props)}


def _post(server, body: dict, tenant: str, path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": server.engine.model_name, "max_tokens": 8, **body}
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(server.url + path, timeout=120, json=body,
                      headers={"authorization": f"Bearer {server.keys[tenant]}"})


def _rows(server, tenant: str) -> list[tuple]:
    with server.db.connect() as c:
        return c.execute(select(UsageEntry.status, UsageEntry.gpu_seconds, UsageEntry.completion_tokens)
                         .where(UsageEntry.tenant == tenant)).all()


def _wait_for_rows(server, tenant: str, count: int, polls: int = 400) -> list[tuple]:
    """The tenant's rows once there are ``count`` (rejected rows are written in the background)."""
    for _ in range(polls):
        if len(rows := _rows(server, tenant)) >= count:
            return rows
        time.sleep(0.05)
    return rows


@pytest.fixture
def live(serve, make_engine):
    server = serve(engine=make_engine(grammar_compile_timeout_s=COMPILE_BUDGET_S, max_model_len=512))
    server.add_tenant("flood", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=8)
    server.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=100)
    return server


def test_a_flood_of_slow_grammars_is_refused_at_once_while_a_premium_tenants_grammar_is_served(live):
    responses: list[httpx.Response] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        r = _post(live, {"structured_outputs": {"json": slow_schema(f"f{i}_")}}, "flood")
        with lock:
            responses.append(r)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(45)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(responses) < 44 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Limit 8 concurrent: 37 refused by the limiter, 7 more because the tenant already compiles one,
    # all while that one compile still runs (it cannot end before its budget).
    assert live.gateway.grammar_slots.under_way("flood") == 1
    assert len(responses) == 44 and all(r.status_code == 429 for r in responses)
    slot_refusals = [r for r in responses if r.json()["error"]["param"] == "structured_outputs"]
    assert len(slot_refusals) >= 7  # more if some came after a refused one gave its concurrency slot back

    premium = _post(live, {"structured_outputs": {"json": SMALL}, "max_tokens": 60, "temperature": 0}, "acme")
    assert premium.status_code == 200
    assert json.loads(premium.json()["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    assert live.gateway.grammar_slots.under_way("flood") == 1  # served while the flood's compile was pending

    for t in threads:
        t.join(timeout=60)
    over_budget = responses[-1]
    assert over_budget.status_code == 400, over_budget.text
    error = over_budget.json()["error"]
    assert error["param"] == "structured_outputs" and error["code"] == "grammar_too_slow"
    rows = _wait_for_rows(live, "flood", 45)
    assert sorted(status for status, _, _ in rows) == ["rejected"] * 45
    # The killed compile is billed to its sender, and only to it.
    assert sorted(gpu for _, gpu, _ in rows)[-1] >= COMPILE_BUDGET_S and sorted(gpu for _, gpu, _ in rows)[-2] == 0
    assert live.gateway.grammar_slots.under_way("flood") == 0


def test_a_grammar_its_tenant_has_no_compile_slot_for_is_refused_before_its_prompt_is_tokenized(live, monkeypatch):
    tokenized: list[str] = []
    token_ids = live.gateway.prompts.token_ids
    monkeypatch.setattr(live.gateway.prompts, "token_ids", lambda req: tokenized.append(req.model) or token_ids(req))
    cached = {"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0}
    assert _post(live, cached, "flood").status_code == 200  # compiled once: in the tenant's cache from now on
    assert len(tokenized) == 1
    assert live.gateway.grammar_slots.take("flood", 1)  # a compile of the tenant's under way
    try:
        r = _post(live, {"structured_outputs": {"choice": ["maybe", "never"]}}, "flood")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["param"] == "structured_outputs"
        assert "grammars compiling" in r.json()["error"]["message"] and r.headers["retry-after"]
        assert len(tokenized) == 1  # refused before the prompt's cost
        assert _post(live, cached, "flood").status_code == 200  # a cached grammar needs no compile slot
        assert len(tokenized) == 2
    finally:
        live.gateway.grammar_slots.give_back("flood")
    rows = _wait_for_rows(live, "flood", 3)
    assert sorted(status for status, _, _ in rows) == ["ok", "ok", "rejected"]


def test_arrays_nested_490_deep_are_a_400_naming_response_format_with_its_ledger_row(live):
    schema = json.loads('{"type":"array","items":' * 490 + '{"type":"integer"}' + "}" * 490)
    r = _post(live, {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}},
              "acme")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format" and "nested" in r.json()["error"]["message"]
    assert _wait_for_rows(live, "acme", 1) == [("rejected", 0.0, 0)]


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type":"array","items":' * 300 + "{}" + "}" * 300)}}], "tool_choice": "required"}, "tools"),
])
def test_any_grammar_nested_past_the_bound_is_a_400_naming_its_parameter(live, body, param):
    r = _post(live, body, "acme")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"choice": ["x" * 900 + str(i) for i in range(1000)]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(f'"{i:07d}"' for i in range(30_000))}},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "(a|b)" * 5000}}, "structured_outputs.regex"),
])
def test_a_grammar_over_its_size_bound_is_a_400_naming_its_parameter_before_any_compile(live, body, param):
    before = live.engine.grammars.compiles
    r = _post(live, body, "acme")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "grammar_too_large"
    assert live.engine.grammars.compiles == before


def test_the_grammar_cache_is_per_tenant(live):
    live.add_tenant("globex", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=100)
    choice = {"structured_outputs": {"choice": ["yes-" + "y" * 50, "no-" + "n" * 50]}}
    before = live.engine.grammars.compiles
    for tenant, compiled in (("acme", 1), ("acme", 1), ("globex", 2)):  # globex never hits acme's entry
        assert _post(live, choice, tenant).status_code == 200
        assert live.engine.grammars.compiles == before + compiled


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_too_slow_for_its_step_budget_ends_its_request_with_a_400_naming_it(serve, make_engine, stream):
    server = serve(engine=make_engine(grammar_mask_budget_s=0.002, max_model_len=512))
    server.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=100)
    body = {"prompt": "go", "max_tokens": 400, "temperature": 0, "structured_outputs": {"grammar": AMBIGUOUS_EBNF},
            "stream": stream}
    r = _post(server, body, "acme", path="/v1/completions")
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")).strip("a") == ""
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["param"] == "structured_outputs" and error["code"] == "grammar_too_slow"
    [(status, gpu_seconds, completion_tokens)] = _wait_for_rows(server, "acme", 1)
    assert status == "error" and 0 < completion_tokens < 400 and gpu_seconds > 0  # billed for what it ran


def test_a_compile_the_machine_is_too_busy_to_run_is_a_503_with_retry_after_and_its_ledger_row(live, monkeypatch):
    # A wall-time limit far below the grammar's CPU time stands in for a machine too busy to run the trial.
    monkeypatch.setattr(grammar_probe, "STARVED_AFTER", 0.05)
    r = _post(live, {"structured_outputs": {"json": slow_schema("busy_")}}, "acme")
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] and r.json()["error"]["code"] == "service_unavailable"
    assert "too busy to compile" in r.json()["error"]["message"]
    [(status, gpu_seconds, _)] = _wait_for_rows(live, "acme", 1)
    assert status == "rejected" and gpu_seconds > 0  # the CPU the trial did get is its sender's
    assert live.gateway.grammar_slots.under_way("acme") == 0
