"""Prompt logprobs over HTTP: OpenAI's ``echo`` (as lm-evaluation-harness scores with it) and vLLM's
``prompt_logprobs``, each equal to the engine's own scores and in the shape its clients read."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from engine.request import EngineRequest, SamplingParams, TokenLogprob

PROMPT = "The cat sat"  # the byte tokenizer: one token a byte


def _post(server, path: str, **body) -> dict:
    r = httpx.post(server.url + path, timeout=60, headers={"authorization": f"Bearer {server.keys['acme']}"},
                   json={"model": server.engine.model_name, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _engine_scores(server, prompt_ids: list[int], k: int) -> tuple[TokenLogprob, ...]:
    async def run():
        request = EngineRequest("direct", prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))
        return [d.prompt_logprobs async for d in server.engine.generate(request) if d.prompt_logprobs is not None]

    [scores] = asyncio.run(run())
    return scores


def test_echo_with_logprobs_answers_an_evaluation_harness_loglikelihood_request(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    # lm-evaluation-harness's local-completions body for loglikelihood, token ids batched by one.
    out = _post(server, "/v1/completions", prompt=[ids], temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    scores = _engine_scores(server, ids, 1)
    assert len(lp["tokens"]) == len(ids) + 1 == out["usage"]["prompt_tokens"] + 1
    assert lp["tokens"][:len(ids)] == [s.token for s in scores]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([s.logprob for s in scores[1:]], abs=1e-5)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    # The harness's own reading: the continuation's summed logprob, and whether greedy would have chosen it.
    ctxlen = 2
    continuation = lp["token_logprobs"][ctxlen:-1]
    greedy = [tok == max(top.values()) for tok, top in zip(continuation, lp["top_logprobs"][ctxlen:-1])]
    assert sum(continuation) == pytest.approx(sum(s.logprob for s in scores[ctxlen:]), abs=1e-4)
    assert greedy == [s.rank == 1 for s in scores[ctxlen:]]
    plain = _post(server, "/v1/completions", prompt=[ids], temperature=0, max_tokens=1)["choices"][0]["text"]
    assert choice["text"] == server.engine.tokenizer.decode(ids) + plain
    assert lp["text_offset"][:len(ids)] == list(range(len(ids)))  # one byte a token
    assert lp["text_offset"][len(ids)] == len(PROMPT)


def test_echo_through_the_openai_client_streamed_and_not_gives_the_same_text_and_tokens(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["acme"])
    kwargs = dict(model=server.engine.model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert whole.text.startswith(PROMPT)
    assert chunks[0].choices[0].text == PROMPT  # the prompt comes first, as a chunk of its own
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens and len(streamed) == len(PROMPT) + 4
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_echo_without_logprobs_prefixes_every_choice_and_scores_nothing(server):
    out = _post(server, "/v1/completions", prompt=PROMPT, max_tokens=3, n=2, temperature=0.7, seed=5, echo=True)
    assert [c["text"][:len(PROMPT)] for c in out["choices"]] == [PROMPT, PROMPT]
    assert all(c["logprobs"] is None and "prompt_logprobs" not in c for c in out["choices"])
    # Without scores to compute, the prompt may come from the prefix cache as any other.
    again = _post(server, "/v1/completions", prompt=PROMPT * 6, max_tokens=1, echo=True)
    cached = _post(server, "/v1/completions", prompt=PROMPT * 6, max_tokens=1, echo=True)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_vllms_prompt_logprobs_on_completions_and_chat(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    out = _post(server, "/v1/completions", prompt=PROMPT, max_tokens=2, n=2, temperature=0.5, seed=3,
                prompt_logprobs=3)
    scores = _engine_scores(server, ids, 3)
    for choice in out["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        for entry, score in zip(entries[1:], scores[1:]):
            mine = entry[str(score.token_id)]
            assert mine["logprob"] == pytest.approx(score.logprob, abs=1e-5) and mine["rank"] == score.rank
            assert mine["decoded_token"] == score.token
            top = sorted(entry.values(), key=lambda e: e["rank"])
            assert len(entry) in (3, 4) and [e["rank"] for e in top][:3] == [1, 2, 3]
    assert out["choices"][0]["prompt_logprobs"] == out["choices"][1]["prompt_logprobs"]

    chat = _post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                 prompt_logprobs=0)
    prompt_tokens = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == prompt_tokens and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in chat["prompt_logprobs"][1:])


def test_prompt_logprobs_are_refused_on_streams_and_past_twenty(server):
    for body in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       headers={"authorization": f"Bearer {server.keys['acme']}"},
                       json={"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
