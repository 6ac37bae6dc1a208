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
