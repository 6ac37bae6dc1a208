"""The key cache's lookups: a burst of requests with a key not yet cached is one lookup, whatever it finds."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from sqlalchemy.exc import OperationalError

from gateway.auth import Authenticator
from gateway.errors import APIError

BURST = 20


class SlowLookup:
    """A key database that takes a while to answer: ``tenant`` for every key, or ``error`` raised."""

    def __init__(self, tenant: object = None, error: Exception | None = None, delay_s: float = 0.05) -> None:
        self.tenant, self.error, self.delay_s = tenant, error, delay_s
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, secret: str) -> object:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.tenant


async def burst(auth: Authenticator, key: str = "tg-new-key") -> list[object]:
    """BURST lookups of one key at once: each one's tenant, or the APIError it raised."""
    results: list[object] = [None] * BURST

    async def one(i: int) -> None:
        try:
            results[i] = await auth.tenant_for(f"Bearer {key}")
        except APIError as e:
            results[i] = e

    async with anyio.create_task_group() as tg:
        for i in range(BURST):
            tg.start_soon(one, i)
    return results


def test_a_burst_of_one_new_key_is_one_lookup_and_every_request_gets_its_tenant():
    lookup = SlowLookup(tenant="acme")
    results = anyio.run(burst, Authenticator(lookup))
    assert results == ["acme"] * BURST
    assert lookup.calls == 1


def test_a_burst_of_an_unknown_key_is_one_lookup_and_every_request_gets_401():
    lookup = SlowLookup(tenant=None)
    results = anyio.run(burst, Authenticator(lookup))
    assert all(isinstance(r, APIError) and r.status == 401 for r in results)
    assert lookup.calls == 1


def test_a_burst_while_the_database_is_down_is_one_attempt_and_every_request_gets_503():
    lookup = SlowLookup(error=OperationalError("select", {}, Exception("connection refused")))
    results = anyio.run(burst, Authenticator(lookup))
    assert all(isinstance(r, APIError) and r.status == 503 and "retry-after" in {k.lower() for k in r.headers}
               for r in results)
    assert lookup.calls == 1


def test_a_request_waiting_on_a_lookup_that_failed_unexpectedly_looks_the_key_up_itself():
    class FailsOnce(SlowLookup):
        def __call__(self, secret: str) -> object:
            tenant = super().__call__(secret)
            if self.calls == 1:
                raise RuntimeError("a bug in the first lookup")
            return tenant

    lookup = FailsOnce(tenant="acme", delay_s=0.1)
    auth = Authenticator(lookup)

    async def main() -> list[object]:
        outcomes: list[object] = []

        async def one() -> None:
            try:
                outcomes.append(await auth.tenant_for("Bearer tg-new-key"))
            except RuntimeError as e:
                outcomes.append(type(e).__name__)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await anyio.sleep(0.03)  # the first is in its lookup; the second waits on it
            tg.start_soon(one)
        return outcomes

    assert anyio.run(main) == ["RuntimeError", "acme"]
    assert lookup.calls == 2


@pytest.mark.parametrize("keys", [2, 5])
def test_different_new_keys_are_looked_up_apart(keys):
    lookup = SlowLookup(tenant="acme")
    auth = Authenticator(lookup)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for k in range(keys):
                tg.start_soon(burst, auth, f"tg-key-{k}")

    anyio.run(main)
    assert lookup.calls == keys


def test_once_the_database_answers_the_servers_check_a_new_key_is_looked_up_at_once():
    """A lookup that failed starts a backoff; the server's own database check answering (/readyz 200) ends it,
    so a key created right after is served rather than refused with 503 for the rest of the backoff."""
    lookup = SlowLookup(error=OperationalError("select", {}, Exception("connection refused")), delay_s=0)
    auth = Authenticator(lookup, clock=lambda: 100.0)  # frozen: the backoff never runs out by itself
    with pytest.raises(APIError) as refused:
        anyio.run(auth.tenant_for, "Bearer tg-new-key")
    assert refused.value.status == 503 and lookup.calls == 1
    lookup.error, lookup.tenant = None, "acme"
    with pytest.raises(APIError):
        anyio.run(auth.tenant_for, "Bearer tg-new-key")  # still backing off: not even tried
    assert lookup.calls == 1

    auth.database_answered()

    assert anyio.run(auth.tenant_for, "Bearer tg-new-key") == "acme" and lookup.calls == 2
