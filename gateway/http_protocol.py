"""uvicorn's httptools protocol, with a fixed-length response sent in one write and a disconnect hook.

uvicorn writes the status line and headers as soon as the app starts a response and
the body in a second write: for a JSON answer that is two send() calls and, for a
client waiting in recv(), two wake-ups where one does. Holding the head back until
the body's first write costs nothing when the body follows at once (a
Content-Length response: Starlette sends it right after the head). Streams
(chunked, SSE) and HEAD answers are written as uvicorn writes them, so a
stream's headers still leave before its first token.

The hook: ASGI tells an app of a client that left only through ``receive()``,
which a handler must keep a task waiting on, at a cost on every request (docs/performance.md).
Instead each request's scope carries a list,
``scope["extensions"][ON_DISCONNECT]``, whose callables the protocol calls when
the connection is lost before the response is complete.

Slow and idle clients (slowloris): a connection must deliver a request's head
within ``header_timeout_s`` of connecting (or, on a kept-alive connection, of the
request's first byte), and its body within ``body_timeout_s`` of the head; past
either it gets a 408 and is closed. uvicorn has neither timeout. Over uvicorn's
``limit_concurrency`` (open connections or requests in flight) a request gets an
OpenAI-shaped 503 with Retry-After, where uvicorn would answer in plain text.

HTTP/1.0 has no chunked encoding: a response uvicorn would send chunked (a
stream) goes to an HTTP/1.0 client as a body delimited by closing the connection.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The scope extension holding a request's disconnect callbacks.
ON_DISCONNECT = "tiergate.on_disconnect"
OVER_CAPACITY_RETRY_S = 1


def _error_body(message: str, type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


_TIMEOUT_BODY = _error_body("The client did not send the whole request in time.", "invalid_request_error",
                            "request_timeout")
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
_OVER_CAPACITY_BODY = _error_body("The server has too many open connections; retry shortly.", "server_error",
                                  "service_unavailable")


async def over_capacity(scope, receive, send) -> None:
    """The ASGI app that answers a request over the connection bound."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(_OVER_CAPACITY_BODY)),
        (b"retry-after", b"%d" % OVER_CAPACITY_RETRY_S), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": _OVER_CAPACITY_BODY})


class HeadHoldingTransport:
    """Wraps one request's transport: holds a Content-Length response's head for the next write."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif data.startswith(b"HTTP/1.1 ") and b"\r\ncontent-length: " in data:
            self._head = data
            return
        self._transport.write(data)

    def close(self) -> None:
        if self._head is not None:  # a response abandoned after its head: the head still goes first
            self._transport.write(self._head)
            self._head = None
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CloseDelimitedTransport:
    """Wraps an HTTP/1.0 request's transport: a chunked response goes out unchunked, ended by the close."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._unchunk = False

    def write(self, data: bytes) -> None:
        if self._unchunk:
            data = _unchunk(data)
        elif data.startswith(b"HTTP/1.1 ") and b"\r\ntransfer-encoding: chunked\r\n" in data:
            data = data.replace(b"\r\ntransfer-encoding: chunked\r\n", b"\r\n", 1)
            self._unchunk = True  # uvicorn closes an HTTP/1.0 connection after the response
        if data:
            self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _unchunk(data: bytes) -> bytes:
    """The payload of whole chunks, as uvicorn writes them: each write holds complete chunks only."""
    out, at = [], 0
    while at < len(data):
        line_end = data.index(b"\r\n", at)
        size = int(data[at:line_end], 16)
        if size == 0:
            break
        out.append(data[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2
    return b"".join(out)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """Pass as ``uvicorn.Config(http=...)``; ``with_timeouts`` gives one with slow-client timeouts."""

    header_timeout_s: float | None = None
    body_timeout_s: float | None = None

    @classmethod
    def with_timeouts(cls, header_timeout_s: float, body_timeout_s: float) -> type[OneWriteHttpToolsProtocol]:
        return type("TimedHttpToolsProtocol", (cls,), {"header_timeout_s": header_timeout_s,
                                                       "body_timeout_s": body_timeout_s})

    _read_timer: asyncio.TimerHandle | None = None

    def _arm(self, timeout_s: float | None, on_timeout) -> None:
        self._disarm()
        if timeout_s is not None:
            self._read_timer = self.loop.call_later(timeout_s, on_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, self._head_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # the first request's head is due within the timeout of connecting
            self._arm(self.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self.scope.setdefault("extensions", {})[ON_DISCONNECT] = []
        self._arm(self.body_timeout_s, self._body_timed_out)
        over = self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency)
        if over:  # uvicorn's own answer here is a plain-text 503 without Retry-After
            app, limit = self.app, self.limit_concurrency
            self.app, self.limit_concurrency = over_capacity, None
            try:
                super().on_headers_complete()
            finally:
                self.app, self.limit_concurrency = app, limit
        else:
            super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or isinstance(cycle.transport, HeadHoldingTransport):
            return
        if cycle.scope.get("http_version") == "1.0":
            cycle.transport = CloseDelimitedTransport(cycle.transport)
        # uvicorn writes nothing after a HEAD response's head, so that head must not wait.
        if cycle.scope.get("method") != "HEAD":
            cycle.transport = HeadHoldingTransport(cycle.transport)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _head_timed_out(self) -> None:
        self._read_timer = None
        if self.cycle is None or self.cycle.response_complete:  # else a response is under way: do not cut in
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        # With a pipelined request queued, the response under way is an earlier request's: do not cut in.
        if cycle is not None and not cycle.response_started and not self.pipeline:
            self.transport.write(REQUEST_TIMEOUT)
            # The app's receive() now answers http.disconnect and its send() writes nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            for callback in list(cycle.scope.get("extensions", {}).get(ON_DISCONNECT, ())):
                callback()
