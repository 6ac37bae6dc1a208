"""vLLM's /tokenize, /detokenize and /tokenizer_info through the official `openai` client's raw calls."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.test_openai_client import client_for


def root_client(server, key: str | None = None) -> openai.OpenAI:
    """The endpoints sit at the server's root, as vLLM's do (lm-evaluation-harness strips /v1/completions)."""
    return openai.OpenAI(base_url=server.url, api_key=key or server.keys["acme"], max_retries=0)


def test_tokenize_gives_the_engines_tokens_their_texts_and_the_context(server):
    client = root_client(server)
    out = client.post("/tokenize", cast_to=object, body={"prompt": "héllo wörld", "return_token_strs": True})
    ids = server.engine.tokenizer.encode("héllo wörld")
    assert out["tokens"] == ids and out["count"] == len(ids)
    assert out["max_model_len"] == server.engine.max_model_len
    assert out["token_strs"] == [server.engine.tokenizer.id_to_token_text(t) for t in ids]
    plain = client.post("/tokenize", cast_to=object, body={"prompt": "hi", "model": server.engine.model_name,
                                                            "add_special_tokens": False})
    assert plain["tokens"] == server.engine.tokenizer.encode("hi", add_special_tokens=False)
    assert plain["token_strs"] is None


def test_tokenized_messages_are_the_prompt_a_chat_request_runs(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = root_client(server).post("/tokenize", cast_to=object, body={"messages": messages})
    chat = client_for(server).chat.completions.create(model=server.engine.model_name, messages=messages,
                                                      max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens


def test_detokenize_gives_back_the_text(server):
    client = root_client(server)
    ids = client.post("/tokenize", cast_to=object, body={"prompt": "round trip"})["tokens"]
    assert client.post("/detokenize", cast_to=object, body={"tokens": ids}) == {"prompt": "round trip"}


def test_tokenizer_info_names_the_special_tokens_the_template_and_the_context(server):
    info = root_client(server).get("/tokenizer_info", cast_to=object)
    tokenizer = server.engine.tokenizer
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == server.engine.max_model_len


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
    ("/tokenize", {"prompt": "x", "model": "someone-elses-adapter"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x" * 200}, "prompt"),
])
def test_bad_bodies_are_4xx_naming_the_parameter(serve, path, body, param):
    live = serve(max_prompt_list_tokens=100)
    live.add_tenant("acme", "premium", rpm=1000, tpm=1_000_000, max_concurrent=10)
    with pytest.raises(openai.APIStatusError) as e:
        root_client(live).post(path, cast_to=object, body=body)
    assert e.value.status_code in (400, 404) and e.value.body["param"] == param


def test_the_endpoints_need_a_key_and_take_one_rpm_unit_each(serve):
    live = serve()
    live.add_tenant("one", "standard", rpm=2, tpm=1000, max_concurrent=1)
    with pytest.raises(openai.AuthenticationError):
        root_client(live, key="tg-nope-nope").get("/tokenizer_info", cast_to=object)
    client = root_client(live, key=live.keys["one"])
    client.get("/tokenizer_info", cast_to=object)
    client.post("/tokenize", cast_to=object, body={"prompt": "a"})
    with pytest.raises(openai.RateLimitError):
        client.post("/detokenize", cast_to=object, body={"tokens": [1]})
