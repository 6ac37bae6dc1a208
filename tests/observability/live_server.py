"""Run an ASGI app under uvicorn on a loopback port in a background thread, for tests that need real sockets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Yield ``host:port`` of ``app`` served on 127.0.0.1 until the block exits."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
