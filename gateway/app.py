"""The Starlette app: routes of DESIGN.md, OpenAI-shaped errors, and the startup/shutdown of what it wires.

``create_app`` takes its parts already built (an engine, a database, a ledger)
so tests and benches can hand it theirs; ``gateway.server`` builds them from
settings for ``tiergate serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable

import anyio.to_thread
from sqlalchemy import Engine as Database
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing import adapters as billing_adapters
from billing.db import UNAVAILABLE
from billing.keys import authenticate, revocation_mark
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.open_rows import close_orphans
from gateway import admin, memory
from gateway.access_log import AccessLogMiddleware
from gateway.load_shedding import LoadShedder, SheddingPolicy
from gateway.auth import DATABASE_RETRY_S, Authenticator, database_unavailable
from gateway import batches_api, budget_admin, files_api, usage_api
from gateway.batch_driver import BatchDriver
from gateway.budget_gate import BudgetGate, make_budget_store
from gateway.completions import chat_completions, completions
from gateway.errors import APIError
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics, render
from gateway.prompts import PromptEncoder
from gateway.ratelimit import RateLimiter, make_limiter
from gateway.services import Gateway
from gateway.settings import Settings
from gateway import responses_api, tokenizer_routes
from gateway.tracing import Tracing
from gateway.usage_recorder import UsageRecorder
from tiergate_common.errors import first_line

log = logging.getLogger(__name__)


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    created = int(gw.started_at)
    base = gw.engine.model_name
    data = [{"id": base, "object": "model", "created": created, "owned_by": "tiergate"}]
    loaded = set(gw.engine.list_adapters())
    for name in sorted(set(tenant.adapters) & loaded):
        data.append({"id": name, "object": "model", "created": created, "owned_by": tenant.tenant,
                     "parent": base, "root": base})
    return JSONResponse({"object": "list", "data": data})


async def metrics_route(request: Request) -> Response:
    body, content_type = render(request.app.state.gateway.metrics)
    return Response(body, headers={"content-type": content_type})


async def healthz(request: Request) -> Response:
    """Liveness: the process serves and the engine loop is alive."""
    gw: Gateway = request.app.state.gateway
    if not gw.engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Readiness: a load balancer should send new requests here (not while draining, nor before the database answered)."""
    gw: Gateway = request.app.state.gateway
    if gw.lifecycle.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not gw.engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    if not gw.database_ready:
        return JSONResponse({"status": "waiting for the database"}, status_code=503,
                            headers={"retry-after": str(round(DATABASE_RETRY_S))})
    return JSONResponse({"status": "ready"})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    log.warning("database unavailable on %s: %s", request.url.path, first_line(exc))
    return database_unavailable().response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, "The server had an error while processing your request.", type="server_error",
                    code="internal_error").response()


def load_registered_adapters(db: Database, engine) -> None:
    """Serve every adapter billing knows; one that fails to load is logged and left unloaded."""
    loaded = set(engine.list_adapters())
    for a in billing_adapters.list_adapters(db):
        if a.name in loaded:
            continue
        try:
            engine.register_adapter(a.name, a.path)
        except Exception as e:
            log.warning("adapter %s (%s) not loaded: %s", a.name, a.path, e)


def create_app(
    settings: Settings,
    engine,
    db: Database,
    ledger: Ledger,
    meter: UsageMeter | None = None,
    limiter: RateLimiter | None = None,
    metrics: GatewayMetrics | None = None,
    tracing: Tracing | None = None,
    prepare_database: Callable[[], None] | None = None,
) -> Starlette:
    """An app serving ``engine``; it starts the engine and ledger at startup and shuts them down at the end.

    ``prepare_database`` (migrations, demo seeding) runs once the database answers; until then
    (and until billing's adapters are loaded and dead processes' open rows closed) /readyz is 503.
    """
    meter = meter or UsageMeter()
    tiers = tuple(engine.config.tiers)
    metrics = metrics or GatewayMetrics(tiers, vllm_names=settings.vllm_metric_names)
    gw = Gateway(
        settings=settings,
        engine=engine,
        db=db,
        usage=UsageRecorder(meter, ledger),
        auth=Authenticator(lambda secret: authenticate(db, secret), ttl_s=settings.auth_cache_ttl_s,
                           stale_if_error_s=settings.auth_stale_if_error_s),
        limiter=limiter or make_limiter(settings.redis_url, window_s=settings.rate_window_s,
                                       key_prefix=settings.redis_key_prefix, lease_s=settings.concurrency_lease_s),
        shedder=LoadShedder(tiers, SheddingPolicy(max_queued=settings.max_queued)),
        metrics=metrics,
        lifecycle=Lifecycle(on_drain=lambda: setattr(metrics, "draining", True)),
        tracing=tracing or Tracing(),
        prompts=PromptEncoder(engine, settings.tokenizer_threads),
    )
    gw.budgets = BudgetGate(db, make_budget_store(settings.redis_url, settings.redis_key_prefix),
                            registry=metrics.registry, webhook_url=settings.budget_webhook_url)
    gw.usage.on_final = gw.budgets.settle
    gw.batch_driver = batch_driver = BatchDriver(gw)
    engine.add_listener(gw.usage.on_engine_event)  # the meter's, through the recorder that takes its records
    engine.add_listener(metrics.on_engine_event)
    engine.add_listener(gw.tracing.on_engine_event)
    metrics.attach_engine(engine)

    def set_up_database() -> None:
        if prepare_database is not None:
            prepare_database()
        load_registered_adapters(db, engine)
        close_orphans(db, settings.ledger_orphan_after_s)

    async def try_database() -> bool:
        try:
            await anyio.to_thread.run_sync(set_up_database)
        except UNAVAILABLE as exc:
            log.warning("database unavailable, /readyz stays 503 until it answers: %s", first_line(exc))
            return False
        gw.auth.database_answered()
        gw.database_ready = True
        return True

    async def wait_for_database() -> None:
        while not await try_database():
            await anyio.sleep(DATABASE_RETRY_S)
        log.info("database ready")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await anyio.to_thread.run_sync(ledger.start)
        background: list[asyncio.Task] = []
        gw.database_ready = False
        # Tried once before serving, so a server whose database is up starts with its adapters loaded;
        # otherwise it serves (health, cached keys) and keeps trying.
        if not await try_database():
            background.append(asyncio.create_task(wait_for_database()))
        engine.start()
        gw.started_at = time.time()
        background += [
            asyncio.create_task(gw.usage.run_background(settings.ledger_checkpoint_s, settings.ledger_orphan_after_s)),
            asyncio.create_task(gw.auth.watch_revocations(lambda: revocation_mark(db), settings.auth_revocation_poll_s)),
            asyncio.create_task(gw.budgets.run_background(settings.budget_poll_s, settings.ledger_orphan_after_s)),
            asyncio.create_task(gw.budgets.notifier.run()),
            asyncio.create_task(memory.trim_forever()),  # freed request buffers go back to the system
            asyncio.create_task(batch_driver.run()),
        ]
        # What startup built (torch, the model, tokenizers) lives as long as the app; frozen out of
        # the collector, it no longer makes each full collection a long pause of the event loop
        # (docs/performance.md). Unfrozen at shutdown.
        gc.freeze()
        try:
            yield
        finally:
            await gw.lifecycle.drain(settings.drain_timeout_s)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await gw.limiter.close()
            await gw.budgets.close()
            await anyio.to_thread.run_sync(engine.shutdown)
            gw.usage.write_unclaimed()
            gw.prompts.close()
            await anyio.to_thread.run_sync(ledger.close)  # writes the rows still queued, 429s included
            gw.tracing.shutdown()
            gc.unfreeze()  # a process that serves several apps in turn (tests) can collect this one

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        *responses_api.routes,
        *tokenizer_routes.routes,
        *files_api.routes,
        *batches_api.routes,
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *admin.routes,
        *budget_admin.routes,
        *usage_api.routes,
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(AccessLogMiddleware)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected,
                            **{cls: _database_unavailable for cls in UNAVAILABLE}},
    )
    app.state.gateway = gw
    return app
