"""Ledger rows from the gateway's side: a finished request's row durable before its last byte, and 429s.

A finished request's row comes from billing's UsageMeter (fed by engine
events) and is made durable (committed, or spooled) by billing's Ledger before
the response ends: on a quiet SQLite ledger by a commit right on the event loop
(cheaper than any thread handoff, and it never waits for a lock), otherwise by
the ledger's writer thread, which group-commits the rows that arrive together
while the loop awaits. Rejected requests cost nothing but are counted; their
rows go to the same writer without waiting, since one commit per 429 would cap
how fast a flood can be refused (the ledger's close() writes what is queued).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread

from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.usage import UsageRecord

log = logging.getLogger(__name__)

FINISH_WAIT_S = 10.0


class UsageRecorder:
    def __init__(self, meter: UsageMeter, ledger: Ledger) -> None:
        self.meter = meter
        self.ledger = ledger
        # Finished requests' records, taken from the meter on the engine thread, until their
        # finish() collects them; the condition serves a finish() that comes before its event.
        self._cond = threading.Condition()
        self._finished: dict[str, UsageRecord] = {}

    # -- admitted requests ------------------------------------------------

    def on_engine_event(self, event: Any) -> None:
        """Engine listener, placed after the meter: parks a finished request's record for finish().

        The engine emits a request's finish event just before its last delta, so finish() almost
        always finds the record here without waiting on a thread for the meter.
        """
        if not hasattr(event, "completion_tokens"):
            return  # a step event
        with self._cond:
            record = self.meter.take_record(event.request_id)
            if record is not None:  # else not one of the gateway's requests, or one finish() gave up on
                self._finished[record.request_id] = record
                self._cond.notify_all()

    async def finish(self, request_id: str, fallback: UsageRecord, status: str | None = None) -> UsageRecord:
        """Wait for the request's finish event, then for its row to be durable; returns the row.

        ``status`` replaces the engine's when the gateway knows better why a request ended (an
        abort the server made while stopping is ``interrupted``, not ``cancelled``). Not
        cancellable, like the worker thread it replaced: a cancelled caller (a client that left)
        still gets its row written before this returns.
        """
        with self._cond:
            record = self._finished.pop(request_id, None)
        if record is not None and status is not None:
            record = replace(record, status=status)
        # A quiet SQLite ledger commits here, on the loop, faster than a handoff to its writer
        # and back; otherwise the writer group-commits the row with whatever else is waiting.
        if record is not None and self.ledger.write_now([record]):
            return record
        with anyio.CancelScope(shield=True):
            if record is None:  # a stream that ended before the engine's finish event (a client that left)
                record = await anyio.to_thread.run_sync(self._wait_record, request_id, fallback)
                if status is not None:
                    record = replace(record, status=status)
                if self.ledger.write_now([record]):
                    return record
            if self.ledger.writing:
                # The writer commits the row whatever happens to this wait; the shield keeps the
                # caller here until it has.
                await asyncio.wrap_future(self.ledger.submit([record]))
            else:  # no writer (a bare app in a test): the write happens inside submit()
                (await anyio.to_thread.run_sync(self.ledger.submit, [record])).result()
        return record

    def _wait_record(self, request_id: str, fallback: UsageRecord) -> UsageRecord:
        with self._cond:
            if self._cond.wait_for(lambda: request_id in self._finished, FINISH_WAIT_S):
                return self._finished.pop(request_id)
            # Under the lock, so a finish event arriving now is either seen above or has its
            # record forgotten here (it then goes with the meter's unclaimed ones).
            self.meter.forget(request_id)
        # The engine never reported the end (it died or never saw the request): the row
        # still goes in, with what the gateway itself saw, so no request goes unbilled.
        log.error("no finish event for %s; writing the gateway's own account of it", request_id)
        return fallback

    # -- rejected requests ------------------------------------------------

    def reject(self, request_id: str, tenant: str, tier: str, adapter: str | None, queued_at: float) -> None:
        record = self.meter.record_rejected(request_id, tenant, tier, adapter, queued_at)
        # Without a running writer (a bare app in a test) submit() writes before returning.
        self.ledger.submit([record]).add_done_callback(_log_failure)


def _log_failure(future: Future) -> None:
    exc = future.exception()
    if exc is not None:
        log.error("ledger row of a rejected request not written", exc_info=exc)


def gateway_record(request_id: str, tenant: str, tier: str, adapter: str | None, status: str, queued_at: float,
                   prompt_tokens: int, completion_tokens: int, first_token_at: float | None) -> UsageRecord:
    """The gateway's own account of a request, used only when the engine's finish event never came."""
    return UsageRecord(
        request_id=request_id, tenant=tenant, tier=tier, adapter=adapter, status=status, queued_at=queued_at,
        finished_at=time.time(), first_token_at=first_token_at, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
