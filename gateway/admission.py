"""Admission of a request that passed its checks: the load shedder, then its tenant's rate limits and budgets.

Each of them reserves something (a rate-limit slot and tokens, a budget hold) that a later refusal or a
failed submit gives back (``release``). Every refusal goes through ``refuse``: counted in
``tiergate_rejections_total{tier,reason}`` and raised; its ledger row is the caller's ``Refusal``
(gateway/usage_recorder.py). Refusals are not traced: a span costs about as much as the rest of a 429,
and a flood of 429s must stay cheap to answer.
"""

from __future__ import annotations

import logging

import anyio

from gateway.errors import APIError, service_unavailable
from gateway.generation import AdmittedRequest
from gateway.ratelimit import Decision, LimiterUnavailable, Limits
from gateway.ratelimit.base import retry_headers
from gateway.services import Gateway

log = logging.getLogger(__name__)

# Metrics labels for the limiter's reasons.
REJECTION_REASON = {"requests": "rpm", "tokens": "tpm", "concurrency": "concurrency"}
# Retry-After when the shared rate limiter cannot be reached.
LIMITER_RETRY_S = 1.0


def refuse(gw: Gateway, tier: str, reason: str, error: APIError) -> APIError:
    """Count a refusal of ``tier`` for ``reason`` (the metric's label); returns ``error``, for the caller to raise."""
    gw.metrics.count_rejection(tier, reason)
    return error


async def reserve(gw: Gateway, admitted: AdmittedRequest, tenant) -> Decision:
    """Admission control, then the tenant's rate limits and budgets; the limiter's decision (its headers go
    on the response). A refusal is counted and raised, and gives back what was reserved."""
    shed = gw.shedder.check(admitted.tier, gw.engine.load(), admitted.tenant)
    if shed is not None:
        raise refuse(gw, admitted.tier, shed.reason, APIError(
            429, shed.message, type="overloaded", code="overloaded", headers=retry_headers(shed.retry_after_s)))
    limits = Limits(tenant.rpm, tenant.tpm, tenant.max_concurrent)
    try:
        # Every sequence (n choices of each prompt) takes a batch slot: the concurrency limit counts them.
        decision = await gw.limiter.acquire(admitted.tenant, limits, admitted.request_id, admitted.reserved_tokens,
                                            admitted.prompts * admitted.n)
    except LimiterUnavailable:
        log.warning("rate limiter unavailable; refusing %s", admitted.request_id, exc_info=True)
        raise service_unavailable("The rate limiter is unavailable; retry shortly.",
                                  headers=retry_headers(LIMITER_RETRY_S)) from None
    if not decision.allowed:
        raise _over_limit(gw, admitted.tier, decision, admitted.reserved_tokens)
    if gw.budgets is not None:
        await _reserve_budget(gw, admitted)
    return decision


async def _reserve_budget(gw: Gateway, admitted: AdmittedRequest) -> None:
    """Reserve against the tenant's budgets (gateway/budget_gate.py); a refusal gives the rate limits back."""
    try:
        await gw.budgets.admit(admitted.request_id, admitted.tenant, admitted.tier, admitted.queued_at,
                               admitted.prompt_tokens, admitted.reserved_tokens - admitted.prompt_tokens)
    except BaseException as e:
        with anyio.CancelScope(shield=True):  # a caller gone meanwhile must not keep its rate-limit slot
            await gw.limiter.release(admitted.tenant, admitted.request_id, admitted.reserved_tokens, 0)
        if isinstance(e, APIError):
            raise refuse(gw, admitted.tier, "budget", e)
        if isinstance(e, LimiterUnavailable):
            log.warning("budget store unavailable; refusing %s", admitted.request_id, exc_info=True)
            raise service_unavailable("The budget store is unavailable; retry shortly.",
                                      headers=retry_headers(LIMITER_RETRY_S)) from None
        raise


async def release(gw: Gateway, admitted: AdmittedRequest) -> None:
    """Give back everything ``reserve`` took, unused: the request never reached the engine."""
    await gw.limiter.release(admitted.tenant, admitted.request_id, admitted.reserved_tokens, 0)
    if gw.budgets is not None:
        await gw.budgets.release(admitted.request_id)


async def count_refusal(gw: Gateway, tenant, request_id: str) -> None:
    """A request refused for its prompt counts against its tenant's RPM (a 429 once over it).

    Reading and measuring a prompt we then refuse is work: were it free, a tenant could
    send megabyte prompts without limit.
    """
    limits = Limits(tenant.rpm, tenant.tpm, tenant.max_concurrent)
    try:
        decision = await gw.limiter.acquire(tenant.tenant, limits, request_id, 0)
        if decision.allowed:
            await gw.limiter.release(tenant.tenant, request_id, 0, 0)
            return
    except LimiterUnavailable:
        return  # the refusal stands as it is: a limiter that is down must not turn a 400 into a 503
    raise _over_limit(gw, tenant.tier, decision, 0)


def _over_limit(gw: Gateway, tier: str, decision: Decision, reserved: int) -> APIError:
    """The 429 of a rate limit ``decision`` refused, counted."""
    return refuse(gw, tier, REJECTION_REASON[decision.reason], APIError(
        429, _limit_message(decision, reserved), type=decision.reason, code="rate_limit_exceeded",
        headers=decision.headers()))


def _limit_message(decision: Decision, reserved: int) -> str:
    limits = decision.limits
    if decision.reason == "concurrency":
        return (f"Rate limit reached for concurrent sequences: limit {limits.max_concurrent} (each of n choices of "
                "each prompt counts one). Retry when one ends.")
    if decision.reason == "requests":
        return f"Rate limit reached for requests per minute (RPM): limit {limits.rpm}, used {limits.rpm}."
    if reserved > limits.tpm:
        return (f"Request too large for tokens per minute (TPM): limit {limits.tpm}, requested {reserved} "
                "(prompt plus max_tokens). Lower max_tokens or the prompt.")
    return (f"Rate limit reached for tokens per minute (TPM): limit {limits.tpm}, remaining "
            f"{max(0, decision.remaining_tokens)}, requested {reserved} (prompt plus max_tokens).")
