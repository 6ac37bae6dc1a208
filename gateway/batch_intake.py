"""A batch's validation, after ``POST /v1/batches`` returned it ``validating``: run by a replica's batch driver.

The driver claims a batch waiting for validation (billing/batch_intake.py, under a lease renewed
as the check goes on), and this reads its input file a chunk at a time from the database, cuts it
into lines (gateway/jsonl_stream.py), checks each with the live endpoints' own checks
(gateway/batch_validation.py), and stores the lines that pass in small groups while no line has
failed. The end is one transaction: ``failed`` with OpenAI's errors naming the lines at fault (or
the queue limit), or ``in_progress`` with every line queued for the drivers. A replica that dies
mid-check leaves the batch to the next claim after its lease; one that stops gives it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio.to_thread

from billing import batch_files, batch_intake
from billing.batch_intake import ValidatingBatch
from billing.batches import LineSpec
from gateway.batch_validation import Checked, check_line
from gateway.errors import APIError
from gateway.jsonl_stream import ENVELOPE_BYTES, LineSplitter
from gateway.services import Gateway

STORE_EVERY = 256  # lines stored per transaction: few round trips, a bounded list in memory


class ValidationLost(Exception):
    """The batch is no longer this replica's to validate (cancelled, or its lease was taken over)."""


async def validate(gw: Gateway, owner: str, lease_s: float, batch: ValidatingBatch, tenant,
                   clock: Callable[[], float] = time.monotonic) -> str | None:
    """Check the batch's lines and end its validation; returns its status then (``in_progress`` or ``failed``), or
    None if it stopped being ``owner``'s meanwhile (what another replica or a cancel decided stands)."""
    checked, seen, pending = Checked(), set(), []
    renewed = clock()

    async def hold(lines: list[LineSpec]) -> None:
        nonlocal renewed
        renewed = clock()
        if not await anyio.to_thread.run_sync(batch_intake.add_lines, gw.db, owner, batch.id, lines, lease_s):
            raise ValidationLost(batch.id)

    async def one(number: int, raw: bytes) -> None:
        if not raw.strip():
            return
        spec = await check_line(gw, tenant, batch.endpoint, number, raw, seen, checked)
        if spec is not None and not checked.errors:  # once a line failed, none is stored: the batch fails
            pending.append(spec)
        if len(pending) >= STORE_EVERY or clock() - renewed >= lease_s / 3:
            await hold(pending if not checked.errors else [])
            pending.clear()

    chunks = await anyio.to_thread.run_sync(batch_files.file_chunks, gw.db, batch.tenant, batch.input_file_id)
    splitter = LineSplitter(gw.settings.max_body_bytes + ENVELOPE_BYTES)
    try:
        if chunks is None:  # deleted before its batch was validated
            checked.fail(None, "file_not_found", f"The input file {batch.input_file_id} was deleted.",
                         "input_file_id")
        else:
            while (chunk := await anyio.to_thread.run_sync(next, chunks, None)) is not None:
                for number, raw in splitter.feed(chunk):
                    await one(number, raw)
            for number, raw in splitter.close():
                await one(number, raw)
    except APIError as e:  # a line longer than any request may be: nothing after it can be read as lines
        checked.fail(splitter.number + 1, e.code or "invalid_json_line", e.message)
    except ValidationLost:
        return None
    if not checked.errors and checked.passed_lines == 0:
        checked.fail(None, "empty_file", "The input file has no lines.", "input_file_id")
    if pending and not checked.errors:
        try:
            await hold(pending)
        except ValidationLost:
            return None
    return await anyio.to_thread.run_sync(
        batch_intake.finish_validation, gw.db, owner, batch.id, checked.errors,
        checked.passed_lines + checked.failed_lines, checked.tokens)
