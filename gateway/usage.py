"""Ledger rows from the gateway's side: a finished request's row written before its last byte, and 429s in batches.

A finished request's row comes from billing's UsageMeter (fed by engine
events), and is committed (or spooled) by billing's Ledger before the response
ends. Rejected requests cost nothing but are counted; one committed
transaction per 429 would cap how fast a flood can be refused, so their rows
are queued and written in batches by one background task.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio.to_thread

from billing.errors import UnknownRequest
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.usage import UsageRecord

log = logging.getLogger(__name__)

FINISH_WAIT_S = 10.0
MAX_BATCH = 1000


class UsageRecorder:
    def __init__(self, meter: UsageMeter, ledger: Ledger) -> None:
        self.meter = meter
        self.ledger = ledger
        self._rejected: asyncio.Queue[UsageRecord] | None = None
        self._flusher: asyncio.Task | None = None

    # -- admitted requests ------------------------------------------------

    async def finish(self, request_id: str, fallback: UsageRecord) -> UsageRecord:
        """Wait for the request's finish event, then make its row durable; returns the row."""
        return await anyio.to_thread.run_sync(self._finish_sync, request_id, fallback)

    def _finish_sync(self, request_id: str, fallback: UsageRecord) -> UsageRecord:
        try:
            record = self.meter.wait_record(request_id, FINISH_WAIT_S)
        except UnknownRequest:
            # The engine never reported the end (it died or never saw the request): the row
            # still goes in, with what the gateway itself saw, so no request goes unbilled.
            log.error("no finish event for %s; writing the gateway's own account of it", request_id)
            self.meter.forget(request_id)
            record = fallback
        self.ledger.write(record)
        return record

    # -- rejected requests ------------------------------------------------

    def reject(self, request_id: str, tenant: str, tier: str, adapter: str | None, queued_at: float) -> None:
        record = self.meter.record_rejected(request_id, tenant, tier, adapter, queued_at)
        if self._rejected is None:  # no flusher running (a bare app in a test): write now
            self.ledger.write(record)
            return
        self._rejected.put_nowait(record)

    def start(self) -> None:
        self._rejected = asyncio.Queue()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
            self._flusher = None
        if self._rejected is not None:
            await self._write_batch(self._take_batch())
            self._rejected = None

    async def _flush_loop(self) -> None:
        assert self._rejected is not None
        while True:
            first = await self._rejected.get()
            self._rejected.put_nowait(first)  # put back: _take_batch drains in order
            await self._write_batch(self._take_batch())

    def _take_batch(self) -> list[UsageRecord]:
        batch: list[UsageRecord] = []
        while self._rejected is not None and not self._rejected.empty() and len(batch) < MAX_BATCH:
            batch.append(self._rejected.get_nowait())
        return batch

    async def _write_batch(self, batch: list[UsageRecord]) -> None:
        if not batch:
            return
        # Shielded: a batch taken off the queue must reach the database or the spool even at shutdown.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.ledger.write_many, batch)


def gateway_record(request_id: str, tenant: str, tier: str, adapter: str | None, status: str, queued_at: float,
                   prompt_tokens: int, completion_tokens: int, first_token_at: float | None) -> UsageRecord:
    """The gateway's own account of a request, used only when the engine's finish event never came."""
    return UsageRecord(
        request_id=request_id, tenant=tenant, tier=tier, adapter=adapter, status=status, queued_at=queued_at,
        finished_at=time.time(), first_token_at=first_token_at, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
