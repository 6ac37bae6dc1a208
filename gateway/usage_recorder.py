"""Ledger rows from the gateway's side: opened as requests run, their progress saved, closed before their last byte.

A stream's row is opened (status `open`) when it is admitted, and is durable
before its first byte; another request's open row is written by the first
progress save, so one that ends within a checkpoint costs a single row write.
While requests run, `run_background` saves their token counts into their rows
every `ledger_checkpoint_s`, so a crash loses at most that much; at its end the final row comes from billing's UsageMeter
(fed by engine events) and is made durable (committed, or spooled) by billing's
Ledger before the response ends: on a quiet SQLite ledger by a commit right on
the event loop (cheaper than any thread handoff, and it never waits for a
lock), otherwise by the ledger's writer thread, which group-commits the rows
that arrive together while the loop awaits. Rejected requests cost nothing but
are counted; their rows go to the same writer without waiting, since one commit
per 429 would cap how fast a flood can be refused (the ledger's close() writes
what is queued).

Every finished request ends in exactly one row: records nobody claims (a
request driven on the engine directly, or a finish event that came after its
request gave up waiting and wrote its own account) are written by the same
background loop; the ledger keeps the first final record of a request id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import anyio
import anyio.to_thread

from billing.db import UNAVAILABLE
from billing.ledger import Ledger
from billing.meter import UsageMeter
from billing.open_rows import PROCESS_OWNER, Progress, close_orphans
from billing.usage_record import UsageRecord
from engine.events import EngineEvent, StepEvent

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
        # Running requests whose open rows the background loop saves: request id -> what tells
        # its count of completion tokens sent so far (asked only by that loop, off the hot path).
        self._running: dict[str, Callable[[], int]] = {}
        # Open rows not written yet (see open()): written by the next progress save unless finished first.
        self._unopened: dict[str, UsageRecord] = {}
        # Called with each final row once it is durable (the budgets settle from it); must not raise.
        self.on_final: Callable[[UsageRecord], Awaitable[None]] | None = None

    # -- open rows --------------------------------------------------------

    def open(self, who: RequestIdentity, prompt_tokens: int, completion_tokens: Callable[[], int],
             now: bool = True) -> Future[bool] | None:
        """Open the admitted request's row and save its progress until finish().

        With ``now`` (a stream, whose first byte shows the client the request id) the row is written at
        once and the future resolves when it is durable. Otherwise it is written with the next progress
        save, so a request that ends within one checkpoint costs one row write, not an open and a close;
        a crash before that save loses no more than the progress saves already leave unsaved.
        """
        record = UsageRecord(request_id=who.request_id, tenant=who.tenant, tier=who.tier, adapter=who.adapter,
                             status="open", queued_at=who.queued_at, finished_at=time.time(),
                             prompt_tokens=prompt_tokens, owner=PROCESS_OWNER)
        self._running[who.request_id] = completion_tokens
        if not now:
            self._unopened[who.request_id] = record
            return None
        opened = self.ledger.submit([record])
        opened.add_done_callback(_log_failure)
        return opened

    async def run_background(self, checkpoint_s: float, orphan_after_s: float) -> None:
        """Until cancelled: save running requests' progress, write unclaimed records, close orphaned rows."""
        last_sweep = time.monotonic()
        while True:
            await anyio.sleep(checkpoint_s)
            try:
                await self._save_progress()
                self.write_unclaimed()
                if time.monotonic() - last_sweep >= orphan_after_s / 2:
                    last_sweep = time.monotonic()
                    await anyio.to_thread.run_sync(close_orphans, self.ledger.engine, orphan_after_s)
            except UNAVAILABLE as exc:
                # Progress is saved again next time; the open rows wait, and the final rows spool.
                log.debug("ledger: progress not saved, database unavailable: %s", exc)
            except Exception:
                log.exception("ledger: background save failed")

    def write_unclaimed(self) -> None:
        """Hand the records nobody claims to the ledger's writer (see the module's docstring)."""
        unclaimed = self.meter.pop_unclaimed()
        if unclaimed:
            self.ledger.submit(unclaimed).add_done_callback(_log_failure)

    async def _save_progress(self) -> None:
        unopened, self._unopened = list(self._unopened.values()), {}
        if unopened:
            # An upsert that cannot reopen a row: one whose final record got there first stays closed.
            await asyncio.wrap_future(self.ledger.submit(unopened))
        running = list(self._running.items())
        if not running:
            return
        gpu = self.meter.gpu_seconds_so_far([request_id for request_id, _ in running])
        progress = [Progress(request_id, tokens(), gpu.get(request_id, 0.0)) for request_id, tokens in running]
        await asyncio.wrap_future(self.ledger.save_progress(progress))

    # -- admitted requests ------------------------------------------------

    def begin(self, who: RequestIdentity) -> None:
        """Meter the request from now on (billing/meter.py): the engine's events for it are its."""
        self.meter.begin(who.request_id, who.tenant, who.tier, who.adapter, who.queued_at)

    def on_engine_event(self, event: EngineEvent) -> None:
        """Engine listener: meters the event, and parks a finished request's record for finish().

        The engine emits a request's finish event just before its last delta, so finish() almost
        always finds the record here without waiting on a thread for the meter.
        """
        if isinstance(event, StepEvent):
            self.meter.on_step(event)
            return
        self.meter.on_finish(event)
        with self._cond:
            record = self.meter.take_record(event.request_id)
            if record is not None:  # else not one of the gateway's requests, or one finish() gave up on
                self._finished[record.request_id] = record
                self._cond.notify_all()

    async def finish(self, request_id: str, fallback: UsageRecord, status: str | None = None) -> UsageRecord:
        """Wait for the request's finish event, then for its row to be durable; returns the row.

        Then ``on_final`` gets the row, shielded like the write.
        """
        record = await self._finish(request_id, fallback, status)
        if self.on_final is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.on_final(record)
                except Exception:  # a budget store outage must not fail a finished response
                    log.exception("settling %s against its budgets failed", request_id)
        return record

    async def _finish(self, request_id: str, fallback: UsageRecord, status: str | None = None) -> UsageRecord:
        """finish() up to the durable row. Not cancellable: a cancelled caller (a client that left) still gets
        its row written before this returns."""
        record = await self.take_final(request_id, fallback, status)
        # A quiet SQLite ledger commits here, on the loop, faster than a handoff to its writer
        # and back; otherwise the writer group-commits the row with whatever else is waiting.
        if self.ledger.write_now([record]):
            return record
        with anyio.CancelScope(shield=True):
            if self.ledger.writing:
                # The writer commits the row whatever happens to this wait; the shield keeps the
                # caller here until it has.
                await asyncio.wrap_future(self.ledger.submit([record]))
            else:  # no writer (a bare app in a test): the write happens inside submit()
                (await anyio.to_thread.run_sync(self.ledger.submit, [record])).result()
        return record

    async def take_final(self, request_id: str, fallback: UsageRecord, status: str | None = None) -> UsageRecord:
        """The request's final record once its finish event came, not written: the caller writes it (finish(), or
        a batch line's result, which goes in with its row in one transaction).

        ``status`` replaces the engine's when the gateway knows better why a request ended (an
        abort the server made while stopping is ``interrupted``, not ``cancelled``)."""
        self._running.pop(request_id, None)
        self._unopened.pop(request_id, None)
        with self._cond:
            record = self._finished.pop(request_id, None)
        if record is None:  # a stream that ended before the engine's finish event (a client that left)
            with anyio.CancelScope(shield=True):
                record = await anyio.to_thread.run_sync(self._wait_record, request_id, fallback)
        return record if status is None else replace(record, status=status)

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

    def reject(self, who: RequestIdentity, status: str = "rejected") -> None:
        record = replace(self.meter.record_rejected(who.request_id, who.tenant, who.tier, who.adapter, who.queued_at),
                         status=status)
        # Without a running writer (a bare app in a test) submit() writes before returning.
        self.ledger.submit([record]).add_done_callback(_log_failure)


@dataclass(frozen=True)
class RequestIdentity:
    """Whose request it is and since when: what its ledger row and the meter's account of it are keyed and
    labelled with. ``AdmittedRequest`` (gateway/generation.py) is one with what admission learnt of it."""

    request_id: str
    tenant: str
    tier: str
    adapter: str | None  # None: the base model
    queued_at: float  # time.time() at arrival


@dataclass
class Refusal:
    """The ledger row of a request whose key is known, for as long as it may still be refused.

    Whatever check refuses it (its body, its model, its prompt, a grammar, a limit), ``record()``
    writes its one row, ``rejected`` at no cost, as a 429's; once the engine has the request,
    ``admitted()`` hands the row to its generation and ``record()`` does nothing.
    """

    usage: UsageRecorder
    who: RequestIdentity  # its adapter set once the body names one
    _settled: bool = False

    def record(self, status: str = "rejected") -> None:
        if self._settled:
            return
        self._settled = True
        self.usage.reject(self.who, status)

    def admitted(self) -> None:
        self._settled = True


def _log_failure(future: Future) -> None:
    exc = future.exception()
    if exc is not None:
        log.error("ledger row of a rejected request not written", exc_info=exc)


def gateway_record(who: RequestIdentity, status: str, prompt_tokens: int, completion_tokens: int,
                   first_token_at: float | None) -> UsageRecord:
    """The gateway's own account of a request, used only when the engine's finish event never came."""
    return UsageRecord(
        request_id=who.request_id, tenant=who.tenant, tier=who.tier, adapter=who.adapter, status=status,
        queued_at=who.queued_at, finished_at=time.time(), first_token_at=first_token_at, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
