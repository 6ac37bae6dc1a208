"""Huge prompts: refused by their length before any tokenizing, counted against their tenant's RPM, and
tokenized off the event loop when they may fit, so /healthz and other tenants' streams stay responsive."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.loader import byte_tokenizer
from engine.tokenizer import TextTokenizer
from gateway.prompts import PromptEncoder
from gateway.schemas import GenerationRequest

# Today's machines answer these in milliseconds; a server whose event loop waits for
# megabyte tokenizations stalls for seconds (3 s a megabyte on this project's box).
RESPONSIVE_S = 2.0


def test_megabyte_prompts_are_refused_unread_count_against_rpm_and_stall_nobody(server):
    model = server.engine.model_name
    flooder = server.add_tenant("flooder", "standard", rpm=5, tpm=10**9, max_concurrent=100)
    huge = json.dumps({"model": model, "prompt": "hello world " * 80_000, "max_tokens": 1}).encode()
    statuses: list[int] = []
    healthz: list[float] = []
    done = threading.Event()

    def flood():
        r = httpx.post(server.url + "/v1/completions", content=huge, timeout=120,
                       headers={"authorization": f"Bearer {flooder}", "content-type": "application/json"})
        statuses.append(r.status_code)
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"

    def probe():
        with httpx.Client(base_url=server.url, timeout=120) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get("/healthz").status_code == 200
                healthz.append(time.monotonic() - started)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    flooders = [threading.Thread(target=flood) for _ in range(6)]
    for t in flooders:
        t.start()
    time.sleep(0.3)  # the flood is being read or tokenized
    started = time.monotonic()
    gaps, last = [], started
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {server.keys['globex']}"},
                      json={"model": model, "prompt": "a neighbour", "max_tokens": 20, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
    for t in flooders:
        t.join(120)
    done.set()
    prober.join(120)

    assert sorted(statuses) == [400] * 5 + [429]  # rpm 5: the sixth refusal is over the limit
    r = httpx.post(server.url + "/v1/completions", timeout=30, headers={"authorization": f"Bearer {flooder}"},
                   json={"model": model, "prompt": "small", "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert max(gaps) < RESPONSIVE_S, f"the neighbour's stream stalled {max(gaps):.2f} s"
    assert max(healthz) < RESPONSIVE_S, f"/healthz stalled {max(healthz):.2f} s"


def test_a_long_prompt_that_may_fit_is_tokenized_while_the_event_loop_runs():
    tokenizer = TextTokenizer(byte_tokenizer())
    encoder = PromptEncoder(SimpleNamespace(tokenizer=tokenizer, max_model_len=1_000_000), threads=1)
    prompt = "hello world " * 30_000  # 360k characters: about a second of tokenizing here

    async def run() -> tuple[list[int], float]:
        longest_gap = 0.0

        async def tick():
            nonlocal longest_gap
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                longest_gap = max(longest_gap, time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        ids = await encoder.token_ids(GenerationRequest(kind="completion", model="m", prompt=prompt))
        ticker.cancel()
        return ids, longest_gap

    try:
        ids, longest_gap = asyncio.run(run())
    finally:
        encoder.close()
    assert len(ids) == len(prompt)  # one byte, one token
    assert longest_gap < 0.5, f"the event loop stalled {longest_gap:.2f} s"


def test_the_character_bound_is_the_context_times_the_longest_token():
    tokenizer = TextTokenizer(byte_tokenizer())
    encoder = PromptEncoder(SimpleNamespace(tokenizer=tokenizer, max_model_len=100), threads=1)
    try:
        assert encoder.max_chars == 100 * tokenizer.max_token_chars
        with pytest.raises(Exception, match="context length"):
            asyncio.run(encoder.token_ids(GenerationRequest(kind="completion", model="m", prompt="x" * 101)))
        assert len(asyncio.run(encoder.token_ids(GenerationRequest(kind="completion", model="m",
                                                                   prompt="x" * 100)))) == 100
    finally:
        encoder.close()
