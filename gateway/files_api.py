"""OpenAI's Files API for the Batch API: upload (multipart, purpose ``batch``), list, read, content, delete.

An upload streams to its store in bounded memory: starlette's multipart parser spools the file part
(to disk past a megabyte), then a worker thread reads the spool a chunk at a time, checks its lines
as they go by (gateway/jsonl_stream.py: OpenAI's limits of 200 MB and 50,000 lines, both settings,
and every line a JSON object) and writes each chunk to the database (billing/batch_files.py) in one
transaction, so a file refused midway leaves nothing stored. What each line asks for is checked
when a batch made from it is validated (gateway/batch_validation.py). A file's content is sent back
a chunk at a time too. Each file is visible only to its tenant: another tenant's id is a 404, as an
unknown one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any

import anyio.to_thread
from sqlalchemy import Engine as Database
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from billing import batch_files
from gateway.errors import APIError, invalid_param
from gateway.jsonl_stream import ENVELOPE_BYTES, JsonlCheck
from gateway.services import Gateway

PURPOSES = ("batch",)  # the only purpose served: what other purposes are for, we do not do
MAX_LIST = 10_000
# Multipart framing and the purpose field around the file itself.
FORM_OVERHEAD_BYTES = 64 * 1024
READ_BYTES = 256 * 1024  # what the store's thread reads of the spool at a time


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="not_found")


def list_limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid_param("limit", f"Invalid 'limit': expected an integer from 1 to {most}, got {raw!r}.")
    return int(raw)


async def upload(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    limit = gw.settings.batch_max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD_BYTES:
        raise APIError(413, f"The file is larger than the limit of {limit} bytes.", code="file_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "Upload the file as multipart/form-data with the fields 'file' and 'purpose'.",
                       code="invalid_content_type")
    parser = MultiPartParser(request.headers, _bounded(request, limit + FORM_OVERHEAD_BYTES), max_files=1,
                             max_fields=4)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise APIError(400, f"The multipart body could not be read: {e}", code="invalid_multipart") from None
    except ClientDisconnect:
        raise APIError(400, "The client closed the connection before sending the whole body.") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(upload, UploadFile):
            raise invalid_param("file", "Missing required parameter: 'file'.", "missing_required_parameter")
        if purpose not in PURPOSES:
            raise invalid_param("purpose", f"Invalid 'purpose': {purpose!r}. Only 'batch' is served.",
                                "invalid_purpose")
        filename = upload.filename or "upload.jsonl"
        check = JsonlCheck(gw.settings.batch_max_file_lines, gw.settings.max_body_bytes + ENVELOPE_BYTES)
        await upload.seek(0)
        info = await anyio.to_thread.run_sync(
            lambda: batch_files.store_file(gw.db, tenant.tenant, purpose, filename[:512],
                                           check.passing(_spooled(upload.file, limit)), lambda: check.count))
    finally:
        await form.close()
    return JSONResponse(info.to_openai())


def _spooled(spool: IO[bytes], limit: int) -> Iterator[bytes]:
    """The spooled file part a chunk at a time, a 413 once past ``limit`` bytes."""
    size = 0
    while chunk := spool.read(READ_BYTES):
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The file is larger than the limit of {limit} bytes.", code="file_too_large")
        yield chunk


async def _bounded(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request's body, a 413 once past ``limit`` bytes: a chunked upload (no content-length) is bounded too."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The file is larger than the limit of {limit - FORM_OVERHEAD_BYTES} bytes.",
                           code="file_too_large")
        yield chunk


async def list_files(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_param("order", f"Invalid 'order': {order!r}; expected 'asc' or 'desc'.")
    limit = list_limit(request, MAX_LIST, MAX_LIST)
    files, has_more = await anyio.to_thread.run_sync(
        lambda: batch_files.list_files(gw.db, tenant.tenant, request.query_params.get("purpose"),
                                       request.query_params.get("after"), limit, order))
    return JSONResponse(page([f.to_openai() for f in files], has_more))


def page(data: list[dict], has_more: bool) -> dict:
    """A list in OpenAI's cursor-page shape."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


async def owned(request: Request, lookup: Callable[[Database, str, str], Any], name: str,
                missing: Callable[[str], APIError]) -> tuple[Gateway, Any]:
    """``lookup(db, tenant, id)`` off the loop for the caller's tenant and the path's id; ``missing(id)`` (a 404)
    when it finds nothing, the same whether the id is unknown or another tenant's."""
    gw: Gateway = request.app.state.gateway
    tenant = await gw.auth.authenticate(request)
    object_id = request.path_params[name]
    found = await anyio.to_thread.run_sync(lookup, gw.db, tenant.tenant, object_id)
    if found is None or found is False:
        raise missing(object_id)
    return gw, found


async def retrieve(request: Request) -> Response:
    _, info = await owned(request, batch_files.get_file, "file_id", not_found)
    return JSONResponse(info.to_openai())


async def content(request: Request) -> Response:
    # A sync iterator: starlette reads each chunk on a worker thread, so the database reads stay off the loop.
    _, chunks = await owned(request, batch_files.file_chunks, "file_id", not_found)
    return StreamingResponse(chunks, media_type="application/octet-stream")


async def delete(request: Request) -> Response:
    await owned(request, batch_files.delete_file, "file_id", not_found)
    return JSONResponse({"id": request.path_params["file_id"], "object": "file", "deleted": True})


routes = [
    Route("/v1/files", upload, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
    Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", content, methods=["GET"]),
]
