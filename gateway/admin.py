"""The /admin API: tenants, keys, adapters (register, load, unload, grant) and usage reports.

Guarded by TIERGATE_ADMIN_TOKEN as a Bearer token; with no token configured
the admin API answers 403 to everyone. Every change that affects admission
clears this replica's auth cache at once (other replicas follow within its TTL).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import asdict
from datetime import date, datetime
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from billing import adapters as billing_adapters
from billing import keys as billing_keys
from billing import tenants as billing_tenants
from billing.errors import AlreadyExists, BillingError, NotFound
from billing.report_formats import as_dicts, render
from billing.reports import usage_report
from gateway.adapter_dirs import AdapterDirError, read_adapter_dir
from gateway.errors import APIError, invalid_param
from gateway.schemas import parse_json_body
from gateway.services import Gateway

MAX_ADMIN_BODY = 64 * 1024


def billing_error(e: BillingError) -> APIError:
    if isinstance(e, NotFound):
        return APIError(404, str(e), code="not_found")
    if isinstance(e, AlreadyExists):
        return APIError(409, str(e), code="conflict")
    return APIError(400, str(e), code="invalid_value")


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a billing function off the event loop, translating its errors into 4xx."""
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except BillingError as e:
        raise billing_error(e) from None


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    token = gw.settings.admin_token
    if not token:
        raise APIError(403, "The admin API is disabled: set TIERGATE_ADMIN_TOKEN to enable it.",
                       type="permission_error", code="admin_disabled")
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "Invalid admin token.", code="invalid_api_key")
    return gw


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_ADMIN_BODY:
        raise APIError(413, "The request body is too large.", code="request_too_large")
    return parse_json_body(raw or b"{}")


def _str(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise invalid_param(name, f"'{name}' must be a non-empty string.", "invalid_type")
    return value


def _tenant_dict(t: Any) -> dict:
    d = asdict(t)
    d["updated_at"] = t.updated_at.isoformat()
    return d


async def create_tenant(request: Request) -> Response:
    gw = _gateway(request)
    body = await _json(request)
    limits = {k: body[k] for k in (*billing_tenants.LIMITS, "weight") if body.get(k) is not None}
    t = await _call(billing_tenants.create_tenant, gw.db, _str(body, "name"), _str(body, "tier"), **limits)
    return JSONResponse(_tenant_dict(t), status_code=201)


async def list_tenants(request: Request) -> Response:
    gw = _gateway(request)
    return JSONResponse({"data": [_tenant_dict(t) for t in await _call(billing_tenants.list_tenants, gw.db)]})


async def set_tenant(request: Request) -> Response:
    gw = _gateway(request)
    changes = {k: v for k, v in (await _json(request)).items() if v is not None}
    unknown = sorted(set(changes) - {"tier", *billing_tenants.LIMITS})
    if unknown:  # "name" too: a tenant is renamed by no one
        raise invalid_param(unknown[0], f"Unknown tenant setting(s): {', '.join(unknown)}; expected tier, "
                            f"{', '.join(billing_tenants.LIMITS)}.", "invalid_value")
    t = await _call(billing_tenants.set_tenant, gw.db, request.path_params["name"], **changes)
    gw.auth.invalidate()
    return JSONResponse(_tenant_dict(t))


async def create_key(request: Request) -> Response:
    gw = _gateway(request)
    key_id, secret = await _call(billing_keys.create_key, gw.db, request.path_params["name"])
    return JSONResponse({"key_id": key_id, "key": secret, "tenant": request.path_params["name"]}, status_code=201)


async def revoke_key(request: Request) -> Response:
    gw = _gateway(request)
    await _call(billing_keys.revoke_key, gw.db, request.path_params["key_id"])
    gw.auth.invalidate()
    return Response(status_code=204)


def _adapter_dict(a: Any, loaded: list[str]) -> dict:
    return {**asdict(a), "tenants": list(a.tenants), "loaded": a.name in loaded}


async def register_adapter(request: Request) -> Response:
    """Register in billing and load into the engine; a directory the engine refuses is not registered."""
    gw = _gateway(request)
    body = await _json(request)
    name, path = _str(body, "name"), _str(body, "path")
    try:
        found = read_adapter_dir(path)
    except AdapterDirError as e:
        raise invalid_param("path", str(e), "invalid_value") from None
    if name == gw.engine.model_name:
        raise invalid_param("name", "An adapter cannot take the base model's name.", "invalid_value")
    existing = {a.name for a in await _call(billing_adapters.list_adapters, gw.db)}
    if name in existing:
        raise APIError(409, f"adapter {name!r} already exists", code="conflict")
    await _engine_load(gw, name, found.path)
    try:
        info = await _call(billing_adapters.register_adapter, gw.db, name, found.path,
                           found.base_model or gw.engine.model_name, found.rank)
    except APIError:
        await anyio.to_thread.run_sync(gw.engine.unregister_adapter, name)
        raise
    return JSONResponse(_adapter_dict(info, gw.engine.list_adapters()), status_code=201)


async def _engine_load(gw: Gateway, name: str, path: str) -> None:
    if name in gw.engine.list_adapters():
        return
    try:
        await anyio.to_thread.run_sync(gw.engine.register_adapter, name, path)
    except Exception as e:  # lora_pool names the problem (rank, modules, shapes, files)
        raise APIError(400, f"The engine refused adapter {name!r}: {e}", param="path", code="invalid_adapter") from None


async def list_adapters(request: Request) -> Response:
    gw = _gateway(request)
    loaded = gw.engine.list_adapters()
    return JSONResponse({"data": [_adapter_dict(a, loaded) for a in await _call(billing_adapters.list_adapters, gw.db)]})


async def _find_adapter(gw: Gateway, name: str) -> Any:
    for a in await _call(billing_adapters.list_adapters, gw.db):
        if a.name == name:
            return a
    raise APIError(404, f"unknown adapter {name!r}", code="not_found")


async def load_adapter(request: Request) -> Response:
    gw = _gateway(request)
    a = await _find_adapter(gw, request.path_params["name"])
    await _engine_load(gw, a.name, a.path)
    return JSONResponse(_adapter_dict(a, gw.engine.list_adapters()))


async def unload_adapter(request: Request) -> Response:
    gw = _gateway(request)
    a = await _find_adapter(gw, request.path_params["name"])
    if a.name in gw.engine.list_adapters():
        try:
            await anyio.to_thread.run_sync(gw.engine.unregister_adapter, a.name)
        except Exception as e:  # e.g. still in use by running requests
            raise APIError(409, f"Adapter {a.name!r} cannot be unloaded now: {e}", code="conflict") from None
    return JSONResponse(_adapter_dict(a, gw.engine.list_adapters()))


async def grant_adapter(request: Request) -> Response:
    gw = _gateway(request)
    tenant = _str(await _json(request), "tenant")
    await _call(billing_adapters.grant, gw.db, request.path_params["name"], tenant)
    gw.auth.invalidate()
    return JSONResponse({"adapter": request.path_params["name"], "tenant": tenant}, status_code=201)


async def revoke_grant(request: Request) -> Response:
    gw = _gateway(request)
    await _call(billing_adapters.revoke_grant, gw.db, request.path_params["name"], request.path_params["tenant"])
    gw.auth.invalidate()
    return Response(status_code=204)


def parse_day(value: str | None, name: str) -> date | datetime:
    if not value:
        raise invalid_param(name, f"'{name}' is required (a date like 2026-01-31 or an ISO datetime).",
                            "missing_required_parameter")
    try:
        return datetime.fromisoformat(value) if "T" in value or " " in value else date.fromisoformat(value)
    except ValueError:
        raise invalid_param(name, f"Invalid '{name}': {value!r} is not a date like 2026-01-31.",
                            "invalid_value") from None


async def usage_report_route(request: Request) -> Response:
    gw = _gateway(request)
    q = request.query_params
    start, end = parse_day(q.get("from"), "from"), parse_day(q.get("to"), "to")
    fmt = q.get("format", "json")
    rows = await _call(usage_report, gw.db, start, end, q.get("group_by", "tier"), q.get("bucket", "day"))
    if fmt == "json":
        return JSONResponse({"data": as_dicts(rows)})
    text = await _call(render, rows, fmt)
    return PlainTextResponse(text, media_type="text/csv" if fmt == "csv" else "text/plain")


routes = [
    Route("/admin/tenants", create_tenant, methods=["POST"]),
    Route("/admin/tenants", list_tenants, methods=["GET"]),
    Route("/admin/tenants/{name}", set_tenant, methods=["PATCH"]),
    Route("/admin/tenants/{name}/keys", create_key, methods=["POST"]),
    Route("/admin/keys/{key_id}", revoke_key, methods=["DELETE"]),
    Route("/admin/adapters", register_adapter, methods=["POST"]),
    Route("/admin/adapters", list_adapters, methods=["GET"]),
    Route("/admin/adapters/{name}/load", load_adapter, methods=["POST"]),
    Route("/admin/adapters/{name}/unload", unload_adapter, methods=["POST"]),
    Route("/admin/adapters/{name}/grants", grant_adapter, methods=["POST"]),
    Route("/admin/adapters/{name}/grants/{tenant}", revoke_grant, methods=["DELETE"]),
    Route("/admin/reports/usage", usage_report_route, methods=["GET"]),
]
