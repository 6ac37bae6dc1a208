"""The /admin API of budgets and prices: PUT/GET/DELETE /admin/tenants/{name}/budget, GET /admin/budgets,
PUT /admin/prices/{tier}, GET /admin/prices.

Guarded like the rest of /admin (gateway/admin.py). A change takes effect on this replica at once
and on the others within their poll of the database (``budget_poll_s``).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing.budgets import DEFAULT_SOFT, DEFAULT_TIMEZONE, BudgetSettings, delete_budget, list_budgets, set_budget
from billing.prices import TierPrice, load_price_book, set_price
from billing.spend import UNITS
from billing.tenants import get_tenant
from gateway.admin import _call, _gateway, _json
from gateway.errors import invalid_param
from gateway.usage_api import budgets_usage

BUDGET_FIELDS = {*UNITS, "period", "soft", "timezone"}
PRICE_FIELDS = ("per_gpu_second", "per_million_prompt_tokens", "per_million_completion_tokens")


def budget_dict(b: BudgetSettings) -> dict[str, Any]:
    return {**asdict(b), "anchored_at": b.anchored_at.isoformat() + "Z", "updated_at": b.updated_at.isoformat() + "Z"}


def price_dict(p: TierPrice) -> dict[str, Any]:
    return {**asdict(p), "effective_from": p.effective_from.isoformat() + "Z"}


def _unknown(body: dict, known: set[str] | tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise invalid_param(unknown[0], f"Unknown field(s): {', '.join(unknown)}; expected "
                            f"{', '.join(sorted(known))}.", "invalid_value")


async def put_budget(request: Request) -> Response:
    gw = _gateway(request)
    body = await _json(request)
    _unknown(body, BUDGET_FIELDS)
    units = [u for u in UNITS if body.get(u) is not None]
    if len(units) != 1:
        raise invalid_param("limit", f"Give exactly one limit: {', '.join(UNITS)}.", "invalid_value")
    b = await _call(set_budget, gw.db, request.path_params["name"], units[0], body[units[0]],
                    body.get("period", "month"), body.get("soft", DEFAULT_SOFT), body.get("timezone", DEFAULT_TIMEZONE))
    await anyio.to_thread.run_sync(gw.budgets.refresh)
    return JSONResponse(budget_dict(b))


async def get_budget(request: Request) -> Response:
    """The tenant's budgets with their current spend, as its own GET /v1/usage shows them."""
    gw = _gateway(request)
    name = request.path_params["name"]
    await _call(get_tenant, gw.db, name)  # 404 for an unknown tenant
    return JSONResponse({"tenant": name, "budgets": await budgets_usage(gw.budgets, gw.db, name)})


async def delete_budget_route(request: Request) -> Response:
    gw = _gateway(request)
    unit = request.query_params.get("unit")
    if unit not in UNITS:
        raise invalid_param("unit", f"'unit' must be one of {', '.join(UNITS)}.", "invalid_value")
    await _call(delete_budget, gw.db, request.path_params["name"], unit)
    await anyio.to_thread.run_sync(gw.budgets.refresh)
    return Response(status_code=204)


async def list_budgets_route(request: Request) -> Response:
    gw = _gateway(request)
    return JSONResponse({"data": [budget_dict(b) for b in await _call(list_budgets, gw.db)]})


async def put_price(request: Request) -> Response:
    gw = _gateway(request)
    body = await _json(request)
    _unknown(body, (*PRICE_FIELDS, "effective_from"))
    for name in PRICE_FIELDS:
        if body.get(name) is None:
            raise invalid_param(name, f"'{name}' is required (0 for free).", "missing_required_parameter")
    when = None
    if body.get("effective_from") is not None:
        try:
            when = datetime.fromisoformat(str(body["effective_from"]).replace("Z", "+00:00"))
        except ValueError:
            raise invalid_param("effective_from", "'effective_from' must be an ISO datetime.", "invalid_value") from None
        if when.tzinfo is not None:
            when = when.astimezone(UTC).replace(tzinfo=None)
    p = await _call(set_price, gw.db, request.path_params["tier"], *(body[n] for n in PRICE_FIELDS), when)
    await anyio.to_thread.run_sync(gw.budgets.refresh)
    return JSONResponse(price_dict(p))


async def list_prices(request: Request) -> Response:
    gw = _gateway(request)
    book = await _call(load_price_book, gw.db)
    return JSONResponse({"data": [price_dict(p) for p in book.history()]})


routes = [
    Route("/admin/tenants/{name}/budget", put_budget, methods=["PUT"]),
    Route("/admin/tenants/{name}/budget", get_budget, methods=["GET"]),
    Route("/admin/tenants/{name}/budget", delete_budget_route, methods=["DELETE"]),
    Route("/admin/budgets", list_budgets_route, methods=["GET"]),
    Route("/admin/prices/{tier}", put_price, methods=["PUT"]),
    Route("/admin/prices", list_prices, methods=["GET"]),
]
