"""The access log: one line per HTTP request, written after the response's last byte has gone out.

uvicorn's own access log is written when the response *starts*, between its head
and its body, so every request (and every stream's first token) waited for its
log line (docs/performance.md). This ASGI middleware writes the same line once the app has
returned, when its response is already with the transport, and adds what
uvicorn's lacks: the request id, the duration, and the caller's tenant and tier
once the key is resolved (``note_caller``, from ``Authenticator.authenticate``). ``tiergate serve`` runs
uvicorn with ``access_log=False`` so there is one line, not two.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tiergate.access")


def note_caller(scope: Scope, tenant: str, tier: str) -> None:
    """Name the authenticated caller for this request's access-log line.

    The line is written outside the handler's log context, so the route leaves the
    names in the request's ``state`` (Starlette's ``request.state``), which is this scope's.
    """
    state = scope.setdefault("state", {})
    state["tenant"], state["tier"] = tenant, tier


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response: dict[str, object] = {"status": 500, "request_id": None}  # 500: what an escaping error becomes

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        response["request_id"] = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
            extra = {"status": response["status"], "duration_ms": round(1000 * (time.perf_counter() - started), 3)}
            if response["request_id"] is not None:
                extra["request_id"] = response["request_id"]
            state = scope.get("state") or {}
            if "tenant" in state:
                extra["tenant"], extra["tier"] = state["tenant"], state["tier"]
            log.info('%s - "%s %s HTTP/%s" %d', peer, scope["method"], path, scope.get("http_version", "1.1"),
                     response["status"], extra=extra)
