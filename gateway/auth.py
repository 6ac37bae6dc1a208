"""API keys to tenants: ``Authorization: Bearer`` parsing and a short-lived cache in front of billing.

The cache keeps the database off the hot path (and off the 429 path, which
must stay cheap under a flood). Staleness is bounded by the TTL across
replicas, and within this replica the admin API clears the cache on every
change, so a revoked key or new limit applies at once here.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from starlette.requests import Request

from gateway.access_log import note_caller
from gateway.errors import APIError, invalid_api_key

Lookup = Callable[[str], Any]  # secret -> TenantInfo, or None for an unknown or revoked key


def bearer_secret(authorization: str | None) -> str:
    if not authorization:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                       code="invalid_api_key")
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise invalid_api_key()
    return secret.strip()


class Authenticator:
    def __init__(self, lookup: Lookup, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.lookup = lookup
        self.ttl_s = ttl_s
        self.clock = clock
        self._cache: dict[str, tuple[float, Any]] = {}

    async def authenticate(self, request: Request) -> Any:
        """The calling tenant's TenantInfo, or an APIError 401; the access-log line names the caller too."""
        tenant = await self.tenant_for(request.headers.get("authorization"))
        note_caller(request.scope, tenant.tenant, tenant.tier)
        return tenant

    async def tenant_for(self, authorization: str | None) -> Any:
        """The caller's TenantInfo, or an APIError 401."""
        secret = bearer_secret(authorization)
        # Cached by digest so a heap dump does not hold the secrets themselves.
        digest = hashlib.sha256(secret.encode()).hexdigest()
        hit = self._cache.get(digest)
        now = self.clock()
        if hit is not None and hit[0] > now:
            tenant = hit[1]
        else:
            tenant = await anyio.to_thread.run_sync(self.lookup, secret)
            # Unknown keys are cached too: a flood of bad keys must not become a flood of queries.
            self._cache[digest] = (now + self.ttl_s, tenant)
            if len(self._cache) > 100_000:
                self._evict_expired(now)
        if tenant is None:
            raise invalid_api_key()
        return tenant

    def invalidate(self) -> None:
        self._cache.clear()

    def _evict_expired(self, now: float) -> None:
        for digest in [d for d, (expires, _) in self._cache.items() if expires <= now]:
            del self._cache[digest]
