"""``tiergate serve`` on a GGUF serves it in its own quantization and answers a chat request; what
it cannot serve (``--quantize`` with a GGUF or on CUDA) is refused in one line with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.tenants import create_tenant
from engine.loader import bundled_gguf_path
from gateway.cli import main
from tests.gateway.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
START_S = 600  # a first start derives the config and tokenizer and may build the kernels


def test_serve_answers_a_chat_request_on_the_bundled_gguf_in_its_own_quantization(tmp_path, engine_cache_dir):
    """With the session's cache: the bundled file's metadata is derived once for every test that serves it."""
    port = free_port()
    env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}",
           "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"), "TIERGATE_CACHE_DIR": str(engine_cache_dir)}
    upgrade(env["TIERGATE_DATABASE_URL"])
    db = create_engine_for(env["TIERGATE_DATABASE_URL"])
    create_tenant(db, "acme", "premium", rpm=1000)
    key = create_key(db, "acme")[1]
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", str(bundled_gguf_path()),
                             "--port", str(port), "--kv-cache-tokens", "4096"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["message"]["content"].strip() and answer["usage"]["completion_tokens"] == 8
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = (tmp_path / "serve.log").read_text()
    assert "served in its own quantization: F32 x61, Q4_1 x210, Q8_0 x1; 92 MiB of quantized weights" in text
    assert "KV pool: 256 blocks of 16 tokens (4096 tokens" in text
    assert not list((tmp_path / "cache").rglob("*.safetensors")), "a float copy of the weights was cached"


@pytest.mark.parametrize("argv, message", [
    (["--model", "bundled", "--quantize", "q8_0"], "--quantize is for Hugging Face checkpoints; "
                                                   "SmolLM2-135M-Instruct.Q4_1.gguf is a GGUF file"),
    (["--device", "cuda", "--quantize", "q4_0"], "quantize is served by the CPU kernels only"),
    (["--dtype", "bfloat16", "--quantize", "q4_k"], "quantize computes activations in float32"),
])
def test_a_quantize_that_cannot_be_served_is_refused_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'serve.db'}")
    monkeypatch.setenv("TIERGATE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
