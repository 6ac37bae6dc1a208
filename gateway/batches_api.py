"""OpenAI's Batches API: create, retrieve, list, cancel.

A batch is created ``validating`` and returned at once; a replica's driver then checks its lines
(gateway/batch_intake.py) and makes it ``in_progress`` with its lines queued, or ``failed`` with
the lines at fault in its ``errors``; the drivers (gateway/batch_driver.py) then run its lines. A
tenant's unfinished batches hold at most its ``batch_queue_tokens`` tokens (billing/tenants.py):
while they hold all of it, creation is a 429 ``batch_token_limit_exceeded``; a batch whose own
tokens do not fit beside them fails its validation with that code. A tenant sees only its own
batches (another's id is a 404).
"""

from __future__ import annotations

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing import batch_files, batches
from billing.batch_intake import QUEUE_LIMIT_CODE
from gateway.batch_validation import ENDPOINTS
from gateway.completions import read_body
from gateway.errors import APIError, invalid_param
from gateway.files_api import list_limit, not_found, owned, page
from gateway.schemas import parse_json_body
from gateway.services import Gateway

WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY
                       and len(v) <= MAX_METADATA_VALUE for k, v in value.items())):
        raise invalid_param("metadata", f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} string pairs, keys of at "
                            f"most {MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}.")
    return value


async def create(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    body = parse_json_body(await read_body(request, gw.settings.max_body_bytes))
    file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(file_id, str) or not file_id:
        raise invalid_param("input_file_id", "Missing required parameter: 'input_file_id'.")
    if endpoint not in ENDPOINTS:
        raise invalid_param("endpoint", f"Invalid 'endpoint': {endpoint!r}. Supported: {', '.join(ENDPOINTS)}.")
    if window not in WINDOWS:
        raise invalid_param("completion_window", f"Invalid 'completion_window': {window!r}. Supported: '24h'.")
    metadata = _metadata(body.get("metadata"))
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
    if unknown:
        raise invalid_param(sorted(unknown)[0], f"Unrecognized request argument supplied: {sorted(unknown)[0]}")
    info = await anyio.to_thread.run_sync(batch_files.get_file, gw.db, tenant.tenant, file_id)
    if info is None:
        raise not_found(file_id)
    if info.purpose != "batch":
        raise invalid_param("input_file_id", f"The file {file_id} has purpose {info.purpose!r}, not 'batch'.")
    try:
        batch = await anyio.to_thread.run_sync(
            lambda: batches.create_batch(gw.db, tenant.tenant, endpoint, file_id, window, metadata, info.line_count,
                                         WINDOWS[window]))
    except batches.BatchQueueFull as e:
        gw.metrics.batches.count_created("refused")
        raise APIError(429, str(e), type="tokens", code=QUEUE_LIMIT_CODE) from None
    gw.metrics.batches.count_created("validating")
    gw.batch_driver.wake()
    return JSONResponse(batch.to_openai())


async def retrieve(request: Request) -> Response:
    _, batch = await owned(request, batches.get_batch, "batch_id", batch_not_found)
    return JSONResponse(batch.to_openai())


async def list_batches(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    limit = list_limit(request, 20, 100)
    found, has_more = await anyio.to_thread.run_sync(batches.list_batches, gw.db, tenant.tenant,
                                                     request.query_params.get("after"), limit)
    return JSONResponse(page([b.to_openai() for b in found], has_more))


async def cancel(request: Request) -> Response:
    gw, batch = await owned(request, batches.cancel_batch, "batch_id", batch_not_found)
    gw.batch_driver.wake()
    return JSONResponse(batch.to_openai())


routes = [
    Route("/v1/batches", create, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"]),
]
