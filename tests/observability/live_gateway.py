"""The real tiergate app (gateway.app.create_app) over a tiny random Llama, served on a loopback port."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.observability.live_server import serve

# A Llama small enough that a CPU step takes milliseconds; random weights, byte-level tokenizer.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# The byte-level tokenizer of dummy models has no chat template; chat needs one.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@dataclass
class LiveGateway:
    target: str  # host:port, for Prometheus
    keys: dict[str, str]  # tenant name -> API key
    engine: object
    app: object

    @property
    def model(self) -> str:
        return self.engine.model_name

    @property
    def url(self) -> str:
        return f"http://{self.target}"

    def client(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.keys[tenant]}"}, timeout=60)


def stream_chat(client: httpx.Client, model: str, content: str, max_tokens: int) -> dict:
    """One streamed chat completion; returns its usage chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    usage = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
    assert usage is not None
    return usage


def complete(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})


def write_tiny_llama(folder: Path) -> Path:
    """The config.json of a random tiny Llama, for EngineConfig(model=f"dummy:{path}")."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder / "config.json"


@contextlib.contextmanager
def live_gateway(workdir: Path, tenants: dict[str, dict], **app_options) -> Iterator[LiveGateway]:
    """Serve the app with ``tenants`` ({name: {"tier": ..., "rpm": ...}}), each given one key."""
    from billing.db import create_engine_for, upgrade
    from billing.keys import create_key
    from billing.ledger import Ledger
    from billing.tenants import create_tenant
    from engine.config import EngineConfig
    from engine.engine import Engine
    from gateway.app import create_app
    from gateway.settings import Settings

    config = write_tiny_llama(workdir / "tiny-llama")
    database_url = f"sqlite:///{workdir / 'tiergate.db'}"
    upgrade(database_url)
    db = create_engine_for(database_url)
    keys = {}
    for name, options in tenants.items():
        create_tenant(db, name, **options)
        keys[name] = create_key(db, name)[1]
    engine = Engine(EngineConfig(model=f"dummy:{config}", num_kv_blocks=128, max_loras=0, max_model_len=256))
    settings = Settings(database_url=database_url, spool_path=str(workdir / "spool.jsonl"), default_max_tokens=8)
    app = create_app(settings, engine, db, Ledger(db, settings.spool_path), **app_options)
    try:
        with serve(app) as target:
            yield LiveGateway(target, keys, engine, app)
    finally:
        db.dispose()
