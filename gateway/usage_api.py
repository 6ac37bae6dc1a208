"""GET /v1/usage: a tenant's own budgets, read with its API key: limit, spent, left, the period, spent per day.

Spent is the ledger's (closed requests; the same rows and prices as `tiergate report`), so it
agrees with the report; ``reserved`` is what requests in flight hold against the budget right
now (the gateway's live state; 0 when not loaded). Only the caller's tenant is ever shown.
The shape is documented in docs/api.md ("/v1/usage").
"""

from __future__ import annotations

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing.budgets import BudgetUsage, budget_usage
from billing.models import utcnow
from gateway.budget_gate import BudgetGate, budget_key
from gateway.services import Gateway

DECIMALS = 6


def usage_dict(usage: BudgetUsage, reserved: float) -> dict:
    b = usage.budget
    rnd = (lambda v: int(round(v))) if b.unit == "tokens" else (lambda v: round(v, DECIMALS))  # noqa: E731
    return {
        "object": "budget",
        "unit": b.unit,
        "limit": rnd(b.limit),
        "spent": rnd(usage.spent),
        "left": rnd(usage.left),
        "reserved": rnd(reserved),
        "soft_limit": rnd(b.soft * b.limit),
        "period": b.period,
        "timezone": b.timezone,
        "period_start": usage.period.start.isoformat() + "Z",
        "period_end": usage.period.end.isoformat() + "Z",
        "days": [{"date": day.isoformat(), "spent": rnd(amount)} for day, amount in usage.days],
    }


async def budgets_usage(gate: BudgetGate, db, tenant: str) -> list[dict]:
    """Every budget of ``tenant`` with its current period's spend (database reads off the event loop)."""
    await anyio.to_thread.run_sync(gate.refresh)
    moment = utcnow()
    out = []
    for budget in gate.budgets.get(tenant, []):
        usage = await anyio.to_thread.run_sync(budget_usage, db, budget, gate.prices, moment)
        state = await gate.store.state(budget_key(budget, moment))
        out.append(usage_dict(usage, state[1] if state else 0.0))
    return out


async def usage(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    budgets = await budgets_usage(gw.budgets, gw.db, tenant.tenant)
    return JSONResponse({"object": "usage", "tenant": tenant.tenant, "budgets": budgets})


routes = [Route("/v1/usage", usage, methods=["GET"])]
