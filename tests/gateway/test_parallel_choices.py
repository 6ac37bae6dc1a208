"""n > 1 through the real `openai` client: several choices, streamed by index, billed as one ledger row."""

from __future__ import annotations

import openai
from sqlalchemy import text


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["acme"], max_retries=0)


def _ledger(server, request_id: str) -> list[tuple[str, int, int]]:
    with server.db.connect() as c:
        rows = c.execute(text("SELECT status, prompt_tokens, completion_tokens FROM usage_ledger "
                              "WHERE request_id = :r"), {"r": request_id})
        return [tuple(r) for r in rows]


def test_n_three_gives_three_different_choices_billed_once(server):
    out = _client(server).chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": "three ways"}], n=3, seed=4,
        max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 3
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 24
    assert _ledger(server, out.id) == [("ok", out.usage.prompt_tokens, 24)]


def test_streamed_choices_carry_their_index_and_match_the_whole_answer(server):
    kwargs = dict(model=server.engine.model_name, prompt="abc", n=2, seed=9, max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    client = _client(server)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        streamed = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index)
        assert streamed == choice.text
    finishing = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishing) == [0, 1] and chunks[-1].usage.completion_tokens == 12


def test_each_choice_of_a_schema_request_is_valid_json(server):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = _client(server).chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": "json"}], n=3, seed=1,
        max_tokens=60, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}})
    assert all(isinstance(json.loads(c.message.content)["ok"], bool) for c in out.choices)
