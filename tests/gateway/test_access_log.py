"""The access log: one line per request, after the response's last byte, with status, duration and request id."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gateway.access_log import AccessLogMiddleware


class Events(logging.Handler):
    """Collects access-log records into the same list the fake ASGI server appends its sends to."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(("log", record))


@pytest.fixture
def events():
    collected: list = []
    logger = logging.getLogger("tiergate.access")
    handler, saved_level = Events(collected), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield collected
    logger.removeHandler(handler)
    logger.setLevel(saved_level)


async def ok(request):
    return JSONResponse({"ok": True}, headers={"x-request-id": "cmpl-42"})


async def stream(request):
    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def boom(request):
    raise RuntimeError("a bug")


APP = AccessLogMiddleware(Starlette(routes=[Route("/ok", ok), Route("/stream", stream), Route("/boom", boom)]))


def call(path: str, events: list, query: bytes = b"") -> None:
    """Drive the app as a server would, noting each message it sends in ``events``."""
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": query,
             "headers": [], "http_version": "1.1", "client": ("10.0.0.7", 5123), "server": ("test", 80),
             "scheme": "http", "root_path": ""}

    bodies = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # as a server does: the next message would be the client's disconnect

    async def send(message):
        events.append(("send", message))

    asyncio.run(APP(scope, receive, send))


def test_the_line_is_written_after_the_last_byte_of_the_response(events):
    call("/ok", events, query=b"a=1")
    kinds = [kind if kind == "log" else message["type"] for kind, message in events]
    assert kinds == ["http.response.start", "http.response.body", "log"]
    record = events[-1][1]
    assert record.getMessage() == '10.0.0.7:5123 - "GET /ok?a=1 HTTP/1.1" 200'
    assert record.status == 200 and record.request_id == "cmpl-42" and record.duration_ms >= 0


def test_a_stream_is_logged_once_after_its_last_chunk(events):
    call("/stream", events)
    kinds = [kind for kind, _ in events]
    assert kinds.count("log") == 1 and kinds[-1] == "log"
    assert not hasattr(events[-1][1], "request_id")  # this response carried none


def test_an_error_escaping_the_app_is_logged_as_500(events):
    with pytest.raises(RuntimeError):
        call("/boom", events)
    record = events[-1][1]
    assert events[-1][0] == "log" and record.status == 500


def test_nothing_is_logged_below_info(events):
    logging.getLogger("tiergate.access").setLevel(logging.WARNING)
    call("/ok", events)
    assert [kind for kind, _ in events] == ["send", "send"]


def test_a_live_completion_writes_one_line_with_its_request_id(serve, events):
    live = serve()
    key = live.add_tenant("acme")
    response = httpx.post(f"{live.url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": live.engine.model_name, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert response.status_code == 200
    [record] = [r for kind, r in events if kind == "log" and r.getMessage().startswith("127.0.0.1:")]
    assert record.request_id == response.headers["x-request-id"] == response.json()["id"]
    assert record.status == 200 and '"POST /v1/completions HTTP/1.1" 200' in record.getMessage()
    assert (record.tenant, record.tier) == ("acme", "premium")


def test_known_callers_are_named_refused_or_not_and_an_unknown_key_is_not(serve, events):
    live = serve()
    key = live.add_tenant("flooder", rpm=1)
    body = {"model": live.engine.model_name, "prompt": "hi", "max_tokens": 1}
    statuses = [httpx.post(f"{live.url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                           json=body, timeout=30).status_code for _ in range(2)]
    statuses.append(httpx.post(f"{live.url}/v1/completions", headers={"authorization": "Bearer nope"},
                               json=body, timeout=30).status_code)
    statuses.append(httpx.get(f"{live.url}/v1/models", headers={"authorization": f"Bearer {key}"},
                              timeout=30).status_code)
    assert statuses == [200, 429, 401, 200]
    records = [r for kind, r in events if kind == "log" and r.getMessage().startswith("127.0.0.1:")]
    assert [(r.status, getattr(r, "tenant", None)) for r in records] == [(200, "flooder"), (429, "flooder"),
                                                                         (401, None), (200, "flooder")]
