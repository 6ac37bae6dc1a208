"""Whatever a client sends, the answer is a 2xx or an OpenAI-shaped 4xx, never a 500, and nothing leaks."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "logprobs", "top_logprobs", "user", "stream", "stream_options", "n", "echo", "suffix"]
KEYS_INSIDE = ["role", "content", "type", "text", "include_usage"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["user", "system", "text"]))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS_INSIDE), inner,
                                                                         max_size=3)),
    max_leaves=8,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), use_real_model=st.booleans())
def test_random_bodies_never_cause_a_server_error(fuzz_server, body, path, use_real_model):
    body = small(body)
    if use_real_model:
        body["model"] = fuzz_server.engine.model_name
    # json.dumps writes NaN and Infinity as Python's json.loads reads them: the server must cope.
    r = httpx.post(fuzz_server.url + path, content=json.dumps(body), timeout=60,
                   headers={"authorization": f"Bearer {fuzz_server.keys['fuzzer']}",
                            "content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    else:
        r.read()
    assert fuzz_server.gateway.lifecycle.in_flight == 0
