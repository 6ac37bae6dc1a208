"""Compiling an admitted request's grammar: a cost paid from its tenant's own budget.

It runs after the tenant's rate limits are counted (the request holds one of
its concurrency slots), on the engine's grammar compiler (its own threads and
worker processes, engine/grammar_compiler.py), and at most
``grammar_compiles_per_tenant`` at once per tenant: one more is a 429 naming the
parameter, at once, so a flood of grammars cannot queue compiles ahead of
other tenants' (``check_compile_room`` gives that 429 as soon as the body is
parsed, before its prompt is tokenized or its rate limits counted). A compile
past its CPU-time budget, or one that fails, is a 400 naming the parameter; one
the machine was too busy to run (compiles get only the CPU the engine leaves)
is a 503 with Retry-After. The compile's CPU seconds are billed to the request
as GPU-seconds (its ledger row's, rejected or not), the one unit our reports
price; a cache hit (per tenant) costs nothing.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from engine.grammar import GrammarError, GrammarSpec
from engine.grammar_probe import CompileStarved, CompileTimeout
from gateway.admission import refuse
from gateway.tenant_slots import TenantSlots
from gateway.errors import APIError, invalid_param, service_unavailable
from gateway.ratelimit.base import retry_headers

# Retry-After of a request refused because its tenant has grammars compiling.
COMPILING_RETRY_S = 1.0
# Retry-After of a request whose compile the machine was too busy to run.
STARVED_RETRY_S = 5.0


async def compile_grammar(gw, tenant, request_id: str, spec: GrammarSpec, param: str) -> object:
    """The compiled grammar of an admitted request (``tenant``: its auth record); 429 or 400 naming ``param``."""
    grammars = gw.engine.grammars
    hit = grammars.cached(spec, tenant.tenant)
    if hit is not None:
        return hit
    slots: TenantSlots = gw.grammar_slots
    if not slots.take(tenant.tenant, _compile_limit(gw, tenant)):
        raise _compiling(gw, tenant, param)
    future = grammars.submit(spec, tenant.tenant)
    # The slot is the compile's, not the caller's: a client that leaves does not free it before
    # the compile ends, so disconnecting cannot queue more compiles than the limit.
    _give_back_when_done(future, slots, tenant.tenant)
    what = "schema" if param in ("response_format", "tools") else "value"
    try:
        compiled = await asyncio.wrap_future(future)
    except CompileTimeout as e:
        gw.usage.meter.charge(request_id, e.cpu_s)
        raise invalid_param(param, f"Invalid {what} for '{param}': {e}; simplify it.", "grammar_too_slow") from None
    except CompileStarved as e:
        gw.usage.meter.charge(request_id, e.cpu_s)
        raise service_unavailable(f"The server is too busy to compile the grammar of '{param}' now; retry later.",
                                  headers=retry_headers(STARVED_RETRY_S)) from None
    except GrammarError as e:
        raise invalid_param(param, f"Invalid {what} for '{param}': {e}", "invalid_value") from None
    gw.usage.meter.charge(request_id, compiled.cpu_s)
    return compiled.grammar


def check_compile_room(gw, tenant, spec: GrammarSpec, param: str) -> None:
    """The 429 ``compile_grammar`` would give, raised before the request costs more: its tenant already
    compiles its limit of grammars and this one is not in the tenant's cache. Called once the body is parsed,
    so that a flood of grammars is refused before each prompt is tokenized and each rate limit counted."""
    full = not gw.grammar_slots.has_room(tenant.tenant, _compile_limit(gw, tenant))
    if full and gw.engine.grammars.cached(spec, tenant.tenant) is None:
        raise _compiling(gw, tenant, param)


def _compile_limit(gw, tenant) -> int:
    return max(1, min(gw.settings.grammar_compiles_per_tenant, tenant.max_concurrent))


def _compiling(gw, tenant, param: str) -> APIError:
    """The 429 of a request whose grammar its tenant has no compile slot for, counted."""
    limit = _compile_limit(gw, tenant)
    return refuse(gw, tenant.tier, "concurrency", APIError(
        429, f"Too many grammars compiling for this key at once: limit {limit}. Retry when one is compiled (a "
        "compiled grammar is reused at no cost).", type="requests", param=param, code="rate_limit_exceeded",
        headers=retry_headers(COMPILING_RETRY_S)))


def _give_back_when_done(future: Future, slots: TenantSlots, tenant: str) -> None:
    loop = asyncio.get_running_loop()

    def done(_: Future) -> None:
        try:
            loop.call_soon_threadsafe(slots.give_back, tenant)
        except RuntimeError:  # the loop closed (server stopped): nothing left to count
            pass

    future.add_done_callback(done)
