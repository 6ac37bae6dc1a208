"""Fixtures for gateway tests: a tiny random Llama, a migrated SQLite database, a live uvicorn server in a thread."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import uvicorn

from billing import keys as billing_keys
from billing import tenants as billing_tenants
from billing.db import create_engine_for, upgrade
from billing.ledger import Ledger
from engine.config import EngineConfig
from engine.engine import Engine
from gateway.app import create_app
from gateway.server import uvicorn_config
from gateway.settings import Settings
from tests.tiny_llama import CHAT_TEMPLATE, write_byte_llama, write_random_adapter

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the 256-token byte tokenizer (every token decodes to text) and a chat template."""
    return write_byte_llama(tmp_path_factory.mktemp("tiny-llama"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 peft LoRA on q and v of the tiny model's shape, with random (non-zero) A and B."""
    return write_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "shout")


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Callable[..., Engine]:
    def make(**overrides) -> Engine:
        cfg = dict(model=f"dummy:{tiny_model_dir}", num_kv_blocks=64, block_size=16, max_model_len=256,
                   max_num_seqs=16, max_num_batched_tokens=256, max_loras=0)
        cfg.update(overrides)
        return Engine(EngineConfig(**cfg))

    return make


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'tiergate.db'}"
    upgrade(url)
    return url


@dataclass
class LiveServer:
    url: str
    app: object
    engine: Engine
    db: object
    server: uvicorn.Server
    thread: threading.Thread
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def gateway(self):
        return self.app.state.gateway

    def add_tenant(self, name: str, tier: str = "premium", **limits) -> str:
        """Create a tenant (if new) and return a fresh key for it."""
        if name not in {t.name for t in billing_tenants.list_tenants(self.db)}:
            billing_tenants.create_tenant(self.db, name, tier, **limits)
        key = billing_keys.create_key(self.db, name)[1]
        self.keys[name] = key
        return key

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app, engine: Engine, db, settings: Settings) -> LiveServer:
    """The app under uvicorn configured as ``tiergate serve`` configures it (timeouts, connection bound)."""
    server = uvicorn.Server(uvicorn_config(replace(settings, log_level="warning"), app))
    port = settings.port
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, engine, db, server, thread)


@pytest.fixture
def serve(make_engine, database_url: str, tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start live servers: ``serve(settings overrides..., engine=..., limiter=...)``; all stopped at teardown."""
    started: list[LiveServer] = []

    def start(engine: Engine | None = None, limiter=None, prepare_database=None, **settings_overrides) -> LiveServer:
        engine = engine or make_engine()
        port = free_port()
        settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN, port=port,
                            spool_path=str(tmp_path / f"spool-{uuid.uuid4().hex}.jsonl"), **settings_overrides)
        db = create_engine_for(database_url)
        ledger = Ledger(db, settings.spool_path, retry_interval_s=0.5)
        app = create_app(settings, engine, db, ledger, limiter=limiter, prepare_database=prepare_database)
        live = start_server(app, engine, db, settings)
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def server(serve) -> LiveServer:
    live = serve()
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    live.add_tenant("globex", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    return live


@pytest.fixture
def unused_port() -> int:
    return free_port()
