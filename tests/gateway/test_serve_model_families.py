"""`tiergate serve --model DIR` on a Gemma 2 checkpoint (sliding windows, soft-caps, sandwich norms):
greedy completions over HTTP give HF transformers' tokens and logprobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.tenants import create_tenant
from tests.engine.conftest import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
GENERATED = 8


@pytest.fixture
def gemma2_server(tmp_path: Path, unused_port: int):
    """(url, API key, checkpoint) of a server started by the CLI on a tiny Gemma 2 directory."""
    model_dir = build_tiny_model(tmp_path / "gemma2", "gemma2")
    database_url = f"sqlite:///{tmp_path / 'serve.db'}"
    upgrade(database_url)
    db = create_engine_for(database_url)
    create_tenant(db, "acme", "premium", rpm=1000)
    key = create_key(db, "acme")[1]
    env = {**os.environ, "TIERGATE_DATABASE_URL": database_url, "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl")}
    command = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--port", str(unused_port)]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{unused_port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise AssertionError(f"tiergate serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("tiergate serve did not become ready")
        yield url, key, model_dir
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@torch.no_grad()
def hf_greedy(model_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids, logprobs = list(prompt), []
    for _ in range(GENERATED):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        ids.append(int(logp.argmax()))
        logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs


def test_served_gemma2_completions_give_hf_greedy_tokens_and_logprobs(gemma2_server):
    url, key, model_dir = gemma2_server
    auth = {"authorization": f"Bearer {key}"}
    prompt = torch.randint(5, 300, (14,), generator=torch.Generator().manual_seed(9)).tolist()  # past the window of 5
    with httpx.Client(timeout=60, headers=auth) as http:
        model = http.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": GENERATED, "temperature": 0, "logprobs": 0,
                "ignore_eos": True}
        reply = http.post(url + "/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        chat = http.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 3})
        assert chat.status_code == 200, chat.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    expected_ids, expected_logprobs = hf_greedy(model_dir, prompt)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert logprobs["tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in expected_ids]
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"], expected_logprobs)) < 1e-3
