"""The batch driver: one per replica, an asyncio task of the app that validates batches and feeds their lines to
the engine.

It validates one ``validating`` batch at a time (gateway/batch_intake.py), and keeps at most
``batch_window`` lines running (the scheduler decides when each runs: tier ``batch`` goes into
spare capacity), claiming more as lines end; renews the leases of its running
lines every third of ``batch_lease_s``; writes each answer with its ledger row once
(billing/batch_lines.py); ends batches with nothing left to run; and refreshes the batch metrics.
Stopping, it interrupts its lines and its validation and gives them back; a replica killed instead
leaves them leased until the lease runs out, then another replica (or its next start) runs them.
A line is run at most MAX_ATTEMPTS times: a run that raises, or whose replica died (its lease ran
out), counts; a line the server stopped or put off ("not now": a 429 or 503 before the engine had it)
does not. The run that would pass the cap writes the line to the error file instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import anyio
import anyio.to_thread

from billing import batch_intake, batch_lines
from billing.batch_intake import ValidatingBatch
from billing.batch_lines import ClaimedLine
from billing.db import UNAVAILABLE
from billing.keys import tenant_info
from billing.open_rows import PROCESS_OWNER
from gateway.batch_intake import validate
from gateway.batch_run import LineInterrupted, LineOutcome, failed_line, run_line
from gateway.errors import APIError
from gateway.generation import Generation
from gateway.services import Gateway
from tiergate_common.errors import first_line

log = logging.getLogger(__name__)

# Runs of a line that keep failing (not a refusal: those are answers) before it is answered with an error.
MAX_ATTEMPTS = 5
ATTEMPTS_CODE = "batch_line_failed"
TENANT_CACHE_S = 5.0  # a grant revoked reaches the lines within this time, as the auth cache's
FINALIZE_EVERY_S = 1.0


class BatchDriver:
    def __init__(self, gw: Gateway, owner: str = PROCESS_OWNER, clock: Callable[[], float] = time.monotonic) -> None:
        self.gw = gw
        self.owner = owner
        self.clock = clock
        self.window = gw.settings.batch_window
        self.lease_s = gw.settings.batch_lease_s
        self.running: dict[tuple[str, int], asyncio.Task] = {}
        self.generations: dict[tuple[str, int], Generation] = {}
        self.validation: asyncio.Task | None = None
        self._tenants: dict[str, tuple[float, object]] = {}
        self._wake = asyncio.Event()
        self.stopping = False

    def wake(self) -> None:
        """Look for lines now (a batch was created, a line ended)."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled: claim, renew, finalize, observe."""
        last_renew = last_finalize = self.clock()
        try:
            while True:
                if self.gw.database_ready and not self.gw.lifecycle.draining:
                    try:
                        await self._claim_validation()
                        await self._claim()
                        now = self.clock()
                        if now - last_renew >= self.lease_s / 3:
                            last_renew = now
                            await anyio.to_thread.run_sync(batch_lines.renew, self.gw.db, self.owner,
                                                           list(self.running), self.lease_s)
                        if now - last_finalize >= FINALIZE_EVERY_S:
                            last_finalize = now
                            await anyio.to_thread.run_sync(batch_lines.finalize, self.gw.db)
                            self.gw.metrics.batches.observe(*await anyio.to_thread.run_sync(batch_lines.counts,
                                                                                           self.gw.db))
                    except UNAVAILABLE as exc:
                        log.warning("batch driver: database unavailable: %s", first_line(exc))
                elif self.gw.lifecycle.draining:  # a line can run again anywhere: the drain need not wait for it
                    for generation in list(self.generations.values()):
                        generation.interrupt()
                self.gw.metrics.batches.running.set(len(self.running))
                self._wake.clear()
                with anyio.move_on_after(self.gw.settings.batch_poll_s):
                    await self._wake.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self.stop()

    async def stop(self) -> None:
        """Interrupt the running lines and give them back to the queue (each line's task does)."""
        self.stopping = True
        for generation in list(self.generations.values()):
            generation.interrupt()
        if self.validation is not None:
            self.validation.cancel()
            await asyncio.gather(self.validation, return_exceptions=True)
        if self.running:
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _claim_validation(self) -> None:
        if self.validation is not None:
            return
        batch = await anyio.to_thread.run_sync(batch_intake.claim_validation, self.gw.db, self.owner, self.lease_s)
        if batch is not None:
            self.validation = asyncio.create_task(self._validate(batch), name=f"batch-validation-{batch.id}")

    async def _validate(self, batch: ValidatingBatch) -> None:
        try:
            tenant = await self._tenant(batch.tenant)
            status = await validate(self.gw, self.owner, self.lease_s, batch, tenant, self.clock)
            if status is not None:
                self.gw.metrics.batches.count_created(status)
        except BaseException as exc:  # stopped, or failed: another replica (or this one) validates it again
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("validating batch %s failed; it will be validated again", batch.id)
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(batch_intake.release_validation, self.gw.db, self.owner, batch.id)
                except UNAVAILABLE:  # its lease runs out instead
                    pass
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.validation = None
            self.wake()

    async def _claim(self) -> None:
        free = self.window - len(self.running)
        if free <= 0:
            return
        claimed = await anyio.to_thread.run_sync(batch_lines.claim, self.gw.db, self.owner, free, self.lease_s)
        for line in claimed:
            self.running[line.key] = asyncio.create_task(self._run(line), name=f"batch-line-{line.batch_id}-{line.line}")

    async def _tenant(self, name: str):
        cached = self._tenants.get(name)
        if cached is not None and self.clock() - cached[0] < TENANT_CACHE_S:
            return cached[1]
        info = await anyio.to_thread.run_sync(tenant_info, self.gw.db, name)
        self._tenants[name] = (self.clock(), info)
        return info

    async def _run(self, line: ClaimedLine) -> None:
        try:
            if line.attempts > MAX_ATTEMPTS:  # its earlier runs' replicas died mid-run (their leases ran out)
                await self._give_up(line)
                return
            tenant = await self._tenant(line.tenant)
            if tenant is None:
                raise LineInterrupted(f"tenant {line.tenant!r} not found")
            outcome = await run_line(self.gw, line, tenant,
                                     on_start=lambda generation: self.generations.__setitem__(line.key, generation))
            await self._write(line, outcome)
        except LineInterrupted:
            await self._give_back(line, counted=False)
        except Exception:
            if line.attempts >= MAX_ATTEMPTS:
                log.exception("batch line %s:%d failed to run %d times; answered with an error", line.batch_id,
                              line.line, line.attempts)
                await self._give_up(line)
            else:
                log.exception("batch line %s:%d failed to run; back to the queue", line.batch_id, line.line)
                await self._give_back(line, counted=True)
        finally:
            self.generations.pop(line.key, None)
            self.running.pop(line.key, None)
            self.wake()

    async def _write(self, line: ClaimedLine, outcome: LineOutcome) -> None:
        """Write the answer and its ledger row; while the database is down, retry for as long as the lease holds
        (the driver renews it meanwhile), then leave the line to whoever claims it next."""
        deadline = self.clock() + self.lease_s
        while True:
            try:
                written = await anyio.to_thread.run_sync(
                    batch_lines.finish_line, self.gw.db, self.owner, line.key, outcome.succeeded, outcome.request_id,
                    outcome.result, outcome.record)
                break
            except UNAVAILABLE:
                if self.clock() > deadline:
                    log.warning("batch line %s:%d: result not written, the database is unavailable; it will run "
                                "again", line.batch_id, line.line)
                    return
                await anyio.sleep(1.0)
        if not written:
            log.warning("batch line %s:%d: lease lost before its result was written; another replica answers it",
                        line.batch_id, line.line)
            return
        if self.gw.usage.on_final is not None:  # the tenant's budgets count the line's row, as a live request's
            try:
                await self.gw.usage.on_final(outcome.record)
            except Exception:
                log.exception("settling batch line %s:%d against its budgets failed", line.batch_id, line.line)

    async def _give_up(self, line: ClaimedLine) -> None:
        """Answer the line with an error saying its runs kept failing (the error file's line, a rejected ledger row)."""
        await self._write(line, failed_line(self.gw, line, line.tenant, APIError(
            500, f"The request failed to run {MAX_ATTEMPTS} times (the server erred or stopped mid-run each time); "
            "it was not answered.", type="server_error", code=ATTEMPTS_CODE)))

    async def _give_back(self, line: ClaimedLine, counted: bool) -> None:
        """Queue the line again; ``counted`` False: this run does not count against its attempts."""
        try:
            await anyio.to_thread.run_sync(batch_lines.release, self.gw.db, self.owner, [line.key], counted)
        except UNAVAILABLE:  # its lease runs out instead (and the run counts)
            pass
