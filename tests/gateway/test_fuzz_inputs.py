"""Whatever a client sends, the answer is a 2xx or an OpenAI-shaped 4xx, never a 500, and nothing leaks.

Bodies are written by hand (``dump``) so they can hold what ``json.dumps`` never
writes: lone surrogate escapes, integer literals past Python's 4300-digit limit,
numbers past float's range, nesting past the recursion limit. Locally each run
explores new examples; under CI the run is derandomized, so a red build is the
same red build when rerun. FUZZ_EXAMPLES=400 explores more by hand.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import ADMIN_TOKEN

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is."""

    text: str


def dump(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)  # ASCII: a lone surrogate goes out as its \u escape, NaN as NaN


def path_part(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


HOSTILE_CHARS = ["a", " ", "\x00", "\n", "\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\U0001f600", "é", "\u202e"]
strings = st.one_of(
    st.text(max_size=20),
    st.text(st.sampled_from(HOSTILE_CHARS), min_size=1, max_size=8),
    st.integers(200, 5000).map(lambda n: "a" * n),
)
raw_numbers_and_nests = st.one_of(
    st.integers(1, 30_000).map(lambda n: Raw("[" * n + "]" * n)),
    st.integers(1, 20_000).map(lambda n: Raw('{"a":' * n + "1" + "}" * n)),
    st.integers(4000, 6000).map(lambda n: Raw("9" * n)),
    st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("-0"), Raw("1E-46"), Raw("1" + "0" * 400)]),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(2**31 - 2, 2**64 + 1),
    st.floats(allow_nan=True), st.sampled_from([1e-300, 1e-46, 5e-324, 1e-5, 1e-6, 2.0000001]),
    strings, st.sampled_from(["user", "system", "text", "premium", "standard"]),
)
values = st.recursive(
    st.one_of(scalars, raw_numbers_and_nests),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]),
                                            inner, max_size=3)),
    max_leaves=8,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "logprobs", "top_logprobs", "user", "stream", "stream_options", "n", "echo", "suffix"]
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)

ADMIN_FIELDS = ["name", "tier", "rpm", "tpm", "max_concurrent", "path", "tenant"]
admin_bodies = st.dictionaries(st.sampled_from(ADMIN_FIELDS), values, max_size=6)
names = strings.filter(lambda n: n != "fuzzer")  # the fuzzing tenant's own limits stay as they are
report_queries = st.dictionaries(st.sampled_from(["from", "to", "group_by", "bucket", "format"]),
                                 st.one_of(strings, st.sampled_from(["2026-01-01", "2026-12-31T00:00", "tier",
                                                                     "tenant", "csv", "table", "hour"])),
                                 max_size=5)
admin_calls = st.one_of(
    st.tuples(st.just("POST"), st.just("/admin/tenants"), admin_bodies),
    st.tuples(st.just("PATCH"), names.map(lambda n: f"/admin/tenants/{path_part(n)}"), admin_bodies),
    st.tuples(st.just("POST"), names.map(lambda n: f"/admin/tenants/{path_part(n)}/keys"), st.none()),
    st.tuples(st.just("DELETE"), names.map(lambda n: f"/admin/keys/{path_part(n)}"), st.none()),
    st.tuples(st.just("POST"), st.just("/admin/adapters"), admin_bodies),
    st.tuples(st.just("POST"), names.map(lambda n: f"/admin/adapters/{path_part(n)}/grants"), admin_bodies),
    st.tuples(st.just("GET"), report_queries.map(
        lambda q: "/admin/reports/usage?" + "&".join(f"{k}={path_part(v)}" for k, v in q.items())), st.none()),
)


@pytest.fixture
def fuzz_server(serve):
    live = serve(default_max_tokens=3)  # a body naming no max_tokens stays quick
    live.add_tenant("fuzzer", "premium", rpm=1_000_000, tpm=1_000_000_000, max_concurrent=1000)
    return live


def small(body: dict) -> dict:
    """Valid token budgets are kept tiny so the examples that do reach the engine finish fast."""
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 3:
            body[name] = 3
    return body


def assert_no_server_error(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body


@FUZZ
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), use_real_model=st.booleans())
def test_random_bodies_never_cause_a_server_error(fuzz_server, body, path, use_real_model):
    body = small(body)
    if use_real_model:
        body["model"] = fuzz_server.engine.model_name
    r = httpx.post(fuzz_server.url + path, content=dump(body).encode(), timeout=60,
                   headers={"authorization": f"Bearer {fuzz_server.keys['fuzzer']}",
                            "content-type": "application/json"})
    assert_no_server_error(r)
    assert fuzz_server.gateway.lifecycle.in_flight == 0


@FUZZ
@given(call=admin_calls)
def test_random_admin_calls_never_cause_a_server_error(fuzz_server, call):
    method, path, body = call
    content = None if body is None else dump(body).encode()
    r = httpx.request(method, fuzz_server.url + path, content=content, timeout=60,
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"})
    assert_no_server_error(r)
