"""logit_bias, the penalties, top_k, min_p and repetition_penalty through HTTP: they reach the
engine, and a token id outside the vocabulary is a 400 naming logit_bias."""

from __future__ import annotations

import httpx


def _complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      headers={"authorization": f"Bearer {server.keys['acme']}"},
                      json={"model": server.engine.model_name, "prompt": "hello", "max_tokens": 5, "ignore_eos": True,
                            **body})


def test_logit_bias_reaches_the_engine_and_forces_its_token(server):
    token = 42
    r = _complete(server, temperature=0.9, seed=3, logit_bias={str(token): 100}, logprobs=0)
    assert r.status_code == 200, r.text
    expected = server.engine.tokenizer.decode([token] * 5)
    assert r.json()["choices"][0]["text"] == expected


def test_penalties_and_vllms_knobs_are_served_together(server):
    r = _complete(server, temperature=0.8, seed=1, top_k=5, min_p=0.05, presence_penalty=1.5, frequency_penalty=0.5,
                  repetition_penalty=1.3)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def test_a_logit_bias_token_outside_the_vocabulary_is_400_naming_it_and_the_engine_serves_on(server):
    vocab = server.engine.limits.vocab_size
    r = _complete(server, logit_bias={str(vocab): 5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and f"logit_bias token ids must be in [0, {vocab})" in error["message"]
    assert _complete(server, logit_bias={str(vocab - 1): 5}).status_code == 200


def _chat(server, messages: list[dict], **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {server.keys['acme']}"},
                      json={"model": server.engine.model_name, "messages": messages, "max_tokens": 1, **body})


def test_chat_template_variables_and_continuing_the_final_message_shape_the_prompt(server):
    """The tiny model's tokenizer spells one token a byte, so prompt_tokens is the rendered prompt's length."""
    user = [{"role": "user", "content": "hi"}]
    plain = _chat(server, user).json()["usage"]["prompt_tokens"]
    assert plain == len("<user>hi\n<assistant>")
    no_think = _chat(server, user, chat_template_kwargs={"enable_thinking": False})
    assert no_think.json()["usage"]["prompt_tokens"] == plain + len("<no_think>")
    go_on = _chat(server, [*user, {"role": "assistant", "content": "The answer is"}], add_generation_prompt=False,
                  continue_final_message=True)
    assert go_on.json()["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>The answer is")


def test_stop_token_ids_end_the_choice_on_their_token_and_one_outside_the_vocabulary_is_400(server):
    token = 65
    r = _complete(server, logit_bias={str(token): 100}, stop_token_ids=[token], max_tokens=5)
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["text"], r.json()["usage"]["completion_tokens"]) == ("stop", "", 1)
    vocab = server.engine.limits.vocab_size
    bad = _complete(server, stop_token_ids=[vocab])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_min_tokens_past_max_tokens_or_beside_a_grammar_is_400(server):
    assert _complete(server, min_tokens=3, max_tokens=2, ignore_eos=False).status_code == 400
    grammar = _complete(server, min_tokens=2, structured_outputs={"choice": ["a", "b"]})
    assert grammar.status_code == 400 and grammar.json()["error"]["param"] == "min_tokens"
    r = _complete(server, min_tokens=5, ignore_eos=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
