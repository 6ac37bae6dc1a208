"""``tiergate serve``: build the engine, database and ledger from settings and run the app under uvicorn.

SIGTERM starts a drain instead of uvicorn's immediate close: the listener
stays open so a load balancer can read /readyz turn 503 while in-flight
requests finish (new ones get 503 with Retry-After); once they are done, or
the drain timeout passes and the rest are interrupted (gateway/lifecycle.py),
uvicorn exits with status 0 and the app's shutdown stops the engine. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from sqlalchemy import Engine as Database
from starlette.applications import Starlette

from billing.db import create_engine_for, upgrade
from billing.ledger import Ledger
from billing.spool import adopt_orphans, process_spool_path
from engine.config import EngineConfig
from scheduler.config import TierConfig, default_tiers
from gateway import memory
from gateway.app import create_app
from gateway.http_protocol import OneWriteHttpToolsProtocol
from gateway.services import Gateway
from gateway.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_SPOOL_DIR = "var/spool"


@dataclass
class Built:
    app: Starlette
    engine: object
    db: Database


def tiers(settings: Settings) -> tuple[TierConfig, ...]:
    """The tiers billing knows (premium, standard, batch), with the premium SLO and reserve the settings give."""
    return default_tiers(premium_slo_s=settings.premium_slo_s, premium_kv_reserve=settings.premium_kv_reserve,
                         premium_tpot_slo_s=settings.premium_tpot_s)


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's part of the settings."""
    return EngineConfig(model=settings.model, device=settings.device, dtype=settings.dtype,
                        policy=settings.scheduler_policy, express_between_layers=settings.express_steps,
                        prefix_cache_scope=settings.prefix_cache_scope, max_model_len=settings.max_model_len,
                        max_loras=settings.max_loras, lora_dtype=settings.lora_dtype, tiers=tiers(settings),
                        max_step_s=settings.step_bound_s, step_bound_factor=settings.step_factor,
                        max_prefill_step_s=settings.prefill_step_bound_s,
                        batch_kv_margin=settings.batch_kv_margin, batch_step_share=settings.batch_step_share,
                        grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
                        grammar_compile_workers=settings.grammar_compile_workers,
                        grammar_cache_bytes=settings.grammar_cache_bytes, grammar_cache_scope=settings.grammar_cache_scope,
                        grammar_mask_budget_s=settings.grammar_mask_budget_s, quantize=settings.quantize,
                        kv_cache_bytes=settings.kv_cache_bytes, kv_cache_tokens=settings.kv_cache_tokens,
                        kv_cache_dtype=settings.kv_cache_dtype,
                        speculative=settings.speculative, num_speculative_tokens=settings.num_speculative_tokens,
                        draft_model=settings.draft_model, draft_num_kv_blocks=settings.draft_kv_blocks)


def build(settings: Settings, migrate: bool = True,
          seed: Callable[[Database, object], None] | None = None) -> Built:
    """Everything ``serve`` needs, from settings; the model is loaded here (the slow part).

    The database need not answer yet: migrations (and ``seed(db, engine)``, the demo's tenants)
    run once it does, and /readyz says 503 until then.
    """
    from engine.engine import Engine  # torch is imported only by commands that serve

    memory.tune()  # before the model loads: its threads' heaps are made under the server's malloc settings
    db = create_engine_for(settings.database_url)
    engine = Engine(engine_config(settings))
    engine.grammars.warm()  # while the rest starts: the first grammar then need not wait for it
    # The prompt-size bound's longest vocabulary entry (gateway/prompts.py): a walk over the whole
    # vocabulary, done here rather than on the event loop of the first request that checks a prompt.
    _ = engine.tokenizer.max_token_chars
    ledger = Ledger(db, settings.spool_path or process_spool_path(DEFAULT_SPOOL_DIR))
    if settings.spool_path is None:
        adopt_orphans(ledger.spool)  # before start(): the ledger replays them with its own

    def prepare_database() -> None:
        if migrate:
            upgrade(settings.database_url)
        if seed is not None:
            seed(db, engine)

    return Built(create_app(settings, engine, db, ledger, prepare_database=prepare_database), engine, db)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now (and end by that signal)
            return
        # Not recorded in _captured_signals, which uvicorn re-raises once it stops: a drain is a
        # clean end, so the process exits 0 (Kubernetes and systemd read a signal death as a failure).
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.gateway.lifecycle.start_draining()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        lifecycle, timeout_s = self.gateway.lifecycle, self.gateway.settings.drain_timeout_s
        log.info("draining: /readyz is 503, waiting up to %.0f s for %d in-flight request(s)",
                 timeout_s, lifecycle.in_flight)
        await lifecycle.drain(timeout_s)
        self.should_exit = True


def uvicorn_config(settings: Settings, app: Starlette) -> uvicorn.Config:
    """How uvicorn serves the app: for ``serve``, and for tests and benches that run the real thing."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=OneWriteHttpToolsProtocol.with_timeouts(settings.header_timeout_s, settings.body_timeout_s),
        limit_concurrency=settings.max_connections,
        log_level=settings.log_level,
        access_log=False,  # the app writes its own, after the response (gateway/access_log.py)
        timeout_graceful_shutdown=5,
        lifespan="on",
        log_config=None,  # logging is configured once by the CLI (JSON lines); uvicorn must not replace it
    )


def serve(settings: Settings, built: Built) -> None:
    DrainingServer(uvicorn_config(settings, built.app), built.app.state.gateway).run()
