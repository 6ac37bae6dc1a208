"""The real `openai` package against a live server: completions, chat, models, auth errors, streaming."""

from __future__ import annotations

import asyncio

import openai
import pytest


def client_for(server, key: str | None = None, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key or server.keys["acme"], **kw)


def test_completion_returns_text_usage_and_finish_reason(server):
    client = client_for(server)
    out = client.completions.create(model=server.engine.model_name, prompt="hello", max_tokens=5, temperature=0)
    assert out.object == "text_completion"
    assert out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == 5
    assert 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_completion_returns_assistant_message(server):
    client = client_for(server)
    out = client.chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_greedy_completion_matches_the_engine_called_directly(server):
    from engine.request import EngineRequest, SamplingParams

    client = client_for(server)
    out = client.completions.create(model=server.engine.model_name, prompt="abc", max_tokens=6, temperature=0)
    ids = server.engine.tokenizer.encode("abc")
    [(text, _)] = server.engine.generate_batch_sync(
        [EngineRequest("direct-1", ids, SamplingParams(max_tokens=6, temperature=0))]
    )
    assert out.choices[0].text == text


def test_streamed_chat_concatenates_to_the_whole_answer_and_ends_with_usage(server):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, messages=[{"role": "user", "content": "stream me"}],
                  max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_streamed_completion_with_logprobs(server):
    client = client_for(server)
    chunks = list(client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=4,
                                            logprobs=2, stream=True))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) >= 1
    lp = next(c.choices[0].logprobs for c in chunks if c.choices[0].logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 + 1 for top in lp.top_logprobs)


def test_chat_logprobs_have_openai_shape(server):
    out = client_for(server).chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": "q"}], max_tokens=3,
        logprobs=True, top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_async_client_streams_and_completes(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.keys["globex"])
        whole = await client.completions.create(model=server.engine.model_name, prompt="async", max_tokens=4)
        stream = await client.completions.create(model=server.engine.model_name, prompt="async", max_tokens=4,
                                                 stream=True)
        parts = [c.choices[0].text async for c in stream]
        await client.close()
        return whole, parts

    whole, parts = asyncio.run(run())
    assert whole.usage.completion_tokens >= 1
    assert len(parts) >= 1


def test_models_list_shows_the_base_model(server):
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]


def test_unknown_key_raises_authentication_error(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client_for(server, key="tg-nope-nope").models.list()
    assert e.value.code == "invalid_api_key"


def test_revoked_key_is_refused_at_once(server):
    import httpx

    key = server.add_tenant("acme")
    key_id = key.split("-")[1]
    client = client_for(server, key=key)
    client.models.list()
    r = httpx.delete(f"{server.url}/admin/keys/{key_id}", headers={"authorization": "Bearer test-admin-token"})
    assert r.status_code == 204
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_unknown_model_is_404_model_not_found(server):
    with pytest.raises(openai.NotFoundError) as e:
        client_for(server).completions.create(model="someone-elses-adapter", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
