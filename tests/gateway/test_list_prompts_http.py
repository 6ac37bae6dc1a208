"""List prompts on /v1/completions through the official `openai` client: one request, choices prompt-major."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.gateway.test_openai_client import client_for
from tests.gateway.test_responses_api import ledger_rows

TEXTS = ["The cat", "sat on a", "mat, and then it"]


def test_each_prompt_of_a_list_gets_n_choices_indexed_prompt_major_as_it_would_alone(server):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, max_tokens=4, temperature=1.0, seed=5, n=2)
    out = client.completions.create(prompt=TEXTS, **kwargs)
    assert [c.index for c in out.choices] == list(range(6))
    alone = [client.completions.create(prompt=text, **kwargs) for text in TEXTS]
    assert [c.text for c in out.choices] == [c.text for one in alone for c in one.choices]
    assert out.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert out.usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)
    assert ledger_rows(server.db, out.id) == [("ok", out.usage.prompt_tokens, out.usage.completion_tokens)]


def test_token_id_lists_scored_with_echo_equal_one_prompt_at_a_time(server):
    # lm-evaluation-harness's loglikelihood body, batched.
    client = client_for(server)
    prompts = [server.engine.tokenizer.encode(t) for t in TEXTS]
    body = dict(model=server.engine.model_name, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    batch = client.completions.create(prompt=prompts, **body)
    for choice, ids in zip(batch.choices, prompts, strict=True):
        [single] = client.completions.create(prompt=[ids], **body).choices
        assert choice.text == single.text
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids) + 1
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(single.logprobs.token_logprobs[1:], abs=1e-5)


def test_a_streamed_list_carries_each_choices_index_and_the_same_text(server):
    client = client_for(server)
    kwargs = dict(model=server.engine.model_name, prompt=TEXTS, max_tokens=5, temperature=0)
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_list_is_one_request_to_rpm_and_reserves_the_sum_of_its_prompts_in_tpm(serve):
    live = serve()
    live.add_tenant("one", "standard", rpm=1, tpm=100_000, max_concurrent=4)
    client = client_for(live, key=live.keys["one"], max_retries=0)
    out = client.completions.create(model=live.engine.model_name, prompt=TEXTS, max_tokens=2)
    assert len(out.choices) == 3
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=live.engine.model_name, prompt="x", max_tokens=2)
    live.add_tenant("few", "standard", rpm=100, tpm=30, max_concurrent=4)
    few = client_for(live, key=live.keys["few"], max_retries=0)
    # 3 prompts of 4 byte tokens and 3 x 2 x 2 completion tokens: 24 fit, one prompt more does not.
    few.completions.create(model=live.engine.model_name, prompt=["abcd"] * 3, max_tokens=2, n=2)
    with pytest.raises(openai.RateLimitError, match="requested 32"):
        few.completions.create(model=live.engine.model_name, prompt=["abcd"] * 4, max_tokens=2, n=2)


@pytest.mark.parametrize("prompt, match", [
    (["a"] * 2049, "at most 2048 prompts"),
    (["x" * 40] * 4, "hold 160 tokens together"),
    (["ok", ""], r"prompt\[1\] is empty"),
    ([[1, 2], [300]], "vocabulary"),
])
def test_a_list_past_its_bounds_is_a_400_naming_prompt_before_anything_runs(serve, prompt, match):
    live = serve(max_prompt_list_tokens=100)
    live.add_tenant("acme", "premium", rpm=1000, tpm=1_000_000, max_concurrent=10)
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client_for(live).completions.create(model=live.engine.model_name, prompt=prompt, max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert live.engine.scheduler.num_used_blocks == 0 and not live.engine.scheduler.has_unfinished()


def test_a_client_leaving_a_streamed_list_ends_every_prompts_sequences(server):
    headers = {"authorization": f"Bearer {server.keys['acme']}"}
    body = {"model": server.engine.model_name, "prompt": TEXTS, "max_tokens": 200, "stream": True, "n": 2,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if '"index":5' in line:
                break
    for _ in range(500):
        if not server.engine.scheduler.has_unfinished():
            break
        time.sleep(0.02)
    assert not server.engine.scheduler.has_unfinished() and server.engine.scheduler.num_used_blocks == 0
