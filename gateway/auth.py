"""API keys to tenants: ``Authorization: Bearer`` parsing and a short-lived cache in front of billing.

The cache keeps the database off the hot path (and off the 429 path, which
must stay cheap under a flood). Within this replica the admin API clears the
cache on every change; a revocation made anywhere else (the CLI, another
replica) reaches every replica's cache through `watch_revocations`.

While the database cannot be reached, keys already seen keep working from the
cache for up to `stale_if_error_s` past their expiry (RFC 5861's stale-if-error)
and unknown keys get 503 with Retry-After; after a failed lookup, the next one
waits `DATABASE_RETRY_S`, so a flood of new keys during an outage is not a
flood of connection attempts.

A burst of requests with a key not yet cached makes one lookup, not one each: the
others wait for its answer. Each lookup is a hop to a worker thread, and a burst of
them had the event loop start threads for them while every stream waited on it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from starlette.requests import Request

from billing.db import UNAVAILABLE
from gateway.access_log import note_caller
from gateway.errors import APIError, invalid_api_key, service_unavailable
from gateway.ratelimit.base import retry_headers
from tiergate_common.errors import first_line

log = logging.getLogger(__name__)

Lookup = Callable[[str], Any]  # secret -> TenantInfo, or None for an unknown or revoked key
# How long after a failed lookup the database is left alone, and the Retry-After of the 503s meanwhile.
DATABASE_RETRY_S = 1.0


@dataclass(frozen=True)
class _Entry:
    expires: float  # fresh until then
    usable_until: float  # served while the database is unreachable until then
    tenant: Any


def bearer_secret(authorization: str | None) -> str:
    if not authorization:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                       code="invalid_api_key")
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise invalid_api_key()
    return secret.strip()


def database_unavailable() -> APIError:
    return service_unavailable("The key database is unavailable; retry shortly.",
                               headers=retry_headers(DATABASE_RETRY_S))


class Authenticator:
    def __init__(self, lookup: Lookup, ttl_s: float = 5.0, stale_if_error_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lookup = lookup
        self.ttl_s = ttl_s
        self.stale_if_error_s = stale_if_error_s
        self.clock = clock
        self._cache: dict[str, _Entry] = {}
        self._looking_up: dict[str, anyio.Event] = {}  # by digest: set when that lookup ends, however it ends
        self._database_down_until = 0.0

    async def authenticate(self, request: Request) -> Any:
        """The calling tenant's TenantInfo, or an APIError 401 (503 while the database is out of reach)."""
        tenant = await self.tenant_for(request.headers.get("authorization"))
        note_caller(request.scope, tenant.tenant, tenant.tier)
        return tenant

    async def tenant_for(self, authorization: str | None) -> Any:
        """The caller's TenantInfo, or an APIError 401 (503 while the database is out of reach)."""
        secret = bearer_secret(authorization)
        # Cached by digest so a heap dump does not hold the secrets themselves.
        digest = hashlib.sha256(secret.encode()).hexdigest()
        entry = self._cache.get(digest)
        now = self.clock()
        if entry is not None and entry.expires > now:
            tenant = entry.tenant
        else:
            tenant = await self._look_up(secret, digest, entry, now)
        if tenant is None:
            raise invalid_api_key()
        return tenant

    async def _look_up(self, secret: str, digest: str, stale: _Entry | None, now: float) -> Any:
        while (pending := self._looking_up.get(digest)) is not None:
            await pending.wait()
            entry = self._cache.get(digest)
            if entry is not None and entry.expires > now:
                return entry.tenant
            # That lookup failed, or its caller left before it ended: look again, or rest as it found.
        if now >= self._database_down_until:
            done = self._looking_up[digest] = anyio.Event()
            try:
                tenant = await anyio.to_thread.run_sync(self.lookup, secret)
            except UNAVAILABLE as exc:
                self._database_down_until = self.clock() + DATABASE_RETRY_S
                log.warning("auth: key database unavailable, serving cached keys: %s", first_line(exc))
            else:
                # Unknown keys are cached too: a flood of bad keys must not become a flood of queries.
                self._cache[digest] = _Entry(now + self.ttl_s, now + self.ttl_s + self.stale_if_error_s, tenant)
                if len(self._cache) > 100_000:
                    self._evict_expired(now)
                return tenant
            finally:
                del self._looking_up[digest]
                done.set()
        if stale is not None and stale.usable_until > now:
            return stale.tenant
        raise database_unavailable()

    def invalidate(self) -> None:
        self._cache.clear()

    def database_answered(self) -> None:
        """The database answered the server's own check (/readyz turns 200): look keys up again at once, not
        after the rest of a backoff begun while it was down, so a ready server serves a new key."""
        self._database_down_until = 0.0

    async def watch_revocations(self, revocation_mark: Callable[[], Any], interval_s: float) -> None:
        """Until cancelled: clear the cache whenever `revocation_mark()` (a cheap database read) changes.

        Polling one indexed aggregate costs the same whatever the request rate, works with or
        without Redis, and bounds how long a key revoked anywhere keeps working to `interval_s`.
        """
        last = None
        while True:
            try:
                mark = await anyio.to_thread.run_sync(revocation_mark)
            except UNAVAILABLE:
                mark = last  # nothing can be revoked while nobody can reach the database
            if mark != last:  # also at the first read: nothing cached before it can be trusted
                if last is not None:
                    log.info("auth: a key was revoked; cached keys are looked up again")
                self.invalidate()
            last = mark
            await anyio.sleep(interval_s)

    def _evict_expired(self, now: float) -> None:
        for digest in [d for d, e in self._cache.items() if e.usable_until <= now]:
            del self._cache[digest]
