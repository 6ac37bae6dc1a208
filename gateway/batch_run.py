"""One batch line through the live path: the same checks, engine request and answer as its endpoint's, on tier
``batch``, without the interactive rate limits; the answer becomes the line of the output or error file.

What differs from a live request is only what a batch's terms change: no load shedding and no RPM, TPM
or concurrency (a batch's limit is the tokens its tenant may have queued, checked at validation), and the
ledger row is not written here: ``BatchGeneration`` keeps it, and the driver writes it together with
the line's result (billing/batch_lines.py), so a line is billed exactly when it is answered.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import anyio

from billing.batch_lines import ClaimedLine
from billing.usage_record import UsageRecord
from gateway.batch_validation import BATCH_TIER, ENDPOINTS, check_body
from gateway.completions import admitted_request
from gateway.errors import APIError
from gateway.generation import Generation
from gateway.grammar_budget import compile_grammar
from gateway.services import Gateway


# Refusals that say "not now" (busy, unavailable) rather than "never": the line goes back to the queue.
TRANSIENT = (429, 503)
COMPILE_WAIT_S, COMPILE_RETRY_S = 60.0, 0.1


class LineInterrupted(Exception):
    """The server stopped the line before its end: it goes back to the queue, unanswered and unbilled."""


@dataclass(frozen=True)
class LineOutcome:
    succeeded: bool  # status 200: the output file; else the error file
    request_id: str
    result: str  # the file's JSON line
    record: UsageRecord  # the line's ledger row


class BatchGeneration(Generation):
    """A line's generation: the live framing, its final row kept for the driver instead of written."""

    record: UsageRecord | None = None

    async def _final_row(self, fallback: UsageRecord, status: str | None) -> UsageRecord:
        self.record = await self.gw.usage.take_final(self.admitted.request_id, fallback, status)
        return self.record

    async def _release(self) -> None:
        """Nothing to give back: a batch line holds no rate limit."""


async def _compile(gw: Gateway, tenant, request_id: str, prepared):
    """The line's grammar compiled; while the tenant's compile slots are busy (its other lines' grammars), it waits
    for one, up to COMPILE_WAIT_S, where a live request would be refused with 429."""
    deadline = time.monotonic() + COMPILE_WAIT_S
    while True:
        try:
            return await compile_grammar(gw, tenant, request_id, prepared.req.grammar, prepared.req.grammar_param)
        except APIError as e:
            if e.status != 429 or time.monotonic() > deadline:
                raise
        await anyio.sleep(COMPILE_RETRY_S)


def failed_line(gw: Gateway, line: ClaimedLine, tenant: str, error: APIError) -> LineOutcome:
    """A line answered with an error before the engine had it; its ledger row is a rejected one, at no cost."""
    request_id = f"{ENDPOINTS[line.endpoint].id_prefix}{gw.ids.getrandbits(128):032x}"
    record = dataclasses.replace(gw.usage.meter.record_rejected(request_id, tenant, BATCH_TIER, None, time.time()),
                                 batch_id=line.batch_id, custom_id=line.custom_id)
    return LineOutcome(False, request_id, output_line(request_id, line.custom_id, error.status, error.body()), record)


def output_line(request_id: str, custom_id: str, status: int, body: dict) -> str:
    """OpenAI's batch output line: the request's status code and body, under its custom_id."""
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None})


async def run_line(gw: Gateway, line: ClaimedLine, tenant, on_start=None) -> LineOutcome:
    """Run one line to its answer; LineInterrupted if the server stopped it meanwhile.

    ``on_start`` gets the line's Generation once the engine has it (the driver interrupts it when stopping)."""
    endpoint = ENDPOINTS[line.endpoint]
    request_id = f"{endpoint.id_prefix}{gw.ids.getrandbits(128):032x}"
    queued_at, arrived = time.time(), time.monotonic()
    tag = {"batch_id": line.batch_id, "custom_id": line.custom_id}
    try:
        prepared = await check_body(gw, endpoint, json.loads(line.body), tenant, request_id)
        adapter = prepared.engine_request.adapter
        request = prepared.engine_request
        if prepared.req.grammar is not None:
            request = dataclasses.replace(request, compiled_grammar=await _compile(gw, tenant, request_id, prepared))
    except APIError as e:
        if e.status in TRANSIENT:  # the tenant's grammar compiles busy, a dependency down: the line runs later
            raise LineInterrupted(request_id) from None
        # The line was valid at validation: a grant revoked since, an adapter unloaded. That is its answer.
        return failed_line(gw, line, tenant.tenant, e)
    admitted = admitted_request(gw, endpoint, prepared, queued_at, arrived)
    req = prepared.req
    trace = gw.tracing.start_request(
        request_id=request_id, operation=endpoint.operation, model=req.model, tenant=tenant.tenant, tier=BATCH_TIER,
        adapter=adapter, max_tokens=prepared.max_tokens, temperature=req.sampling.temperature,
        top_p=req.sampling.top_p, top_k=req.sampling.top_k or None, seed=req.sampling.seed, stream=False, headers={})
    gw.usage.begin(admitted)
    trace.mark_submitted()
    try:
        stream = gw.engine.submit(request)
    except Exception:
        gw.usage.meter.forget(request_id)
        trace.finish(error="not submitted")
        raise
    generation = BatchGeneration(admitted, stream, gw, trace)
    if on_start is not None:
        on_start(generation)
    response = await generation.collect()
    if generation.interrupted:  # stopped by the server: not this line's fault, it runs again uncounted
        raise LineInterrupted(request_id)
    if generation.record is None:  # the engine ended it with no answer: a failed run, counted
        raise RuntimeError(f"batch line {line.batch_id}:{line.line}: the engine ended {request_id} with no answer")
    record = dataclasses.replace(generation.record, **tag)
    status = response.status_code
    return LineOutcome(status == 200, request_id,
                       output_line(request_id, line.custom_id, status, json.loads(response.body)), record)
