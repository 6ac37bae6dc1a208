"""Slow and hostile clients over raw sockets: slow heads and bodies are cut, the connection bound answers 503,
and an HTTP/1.0 stream is close-delimited (HTTP/1.0 has no chunked encoding)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

TIMEOUT_S = 1.0
# A connection the server keeps open stays open this long in the tests: far past its timeouts.
PATIENCE_S = 8.0


@pytest.fixture
def slow_server(serve):
    live = serve(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_connections=4)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    return live


def connect(server) -> socket.socket:
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=PATIENCE_S)
    return sock


def drip_until_closed(sock: socket.socket, data: bytes, every_s: float = 0.2) -> tuple[float, bytes]:
    """Send ``data`` a byte at a time; the seconds until the server closed the connection, and what it sent."""
    started = time.monotonic()
    sock.settimeout(every_s)
    received = b""
    for i in range(len(data)):
        if time.monotonic() - started > PATIENCE_S:
            break
        try:
            sock.sendall(data[i:i + 1])
        except OSError:  # reset: closed
            return time.monotonic() - started, received
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - started, received
        if not chunk:
            return time.monotonic() - started, received
        received += chunk
    return time.monotonic() - started, received


def test_a_head_sent_slowly_is_cut_off_after_the_header_timeout(slow_server):
    with connect(slow_server) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + b"x-slow: " + b"a" * 200 + b"\r\n\r\n"
        elapsed, received = drip_until_closed(sock, head)
    assert elapsed < TIMEOUT_S + 3, f"still open after {elapsed:.1f} s"
    assert received.startswith(b"HTTP/1.1 408 ")
    assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(slow_server):
    with connect(slow_server) as sock:
        started = time.monotonic()
        received = sock.recv(65536)
        assert sock.recv(65536) == b""
    assert time.monotonic() - started < TIMEOUT_S + 3
    assert received.startswith(b"HTTP/1.1 408 ")


def test_a_body_sent_slowly_is_cut_off_and_frees_everything(slow_server):
    key = slow_server.keys["acme"]
    body = json.dumps({"model": slow_server.engine.model_name, "prompt": "hi" * 100, "max_tokens": 1}).encode()
    with connect(slow_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body))
        elapsed, received = drip_until_closed(sock, body)
    assert elapsed < TIMEOUT_S + 3, f"still open after {elapsed:.1f} s"
    assert received.startswith(b"HTTP/1.1 408 ")
    assert slow_server.gateway.lifecycle.in_flight == 0


def test_past_the_connection_bound_a_request_gets_503_with_retry_after(slow_server):
    idle = [connect(slow_server) for _ in range(4)]
    try:
        time.sleep(0.2)  # the server has accepted them all
        with connect(slow_server) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
    finally:
        for s in idle:
            s.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == "service_unavailable"
    time.sleep(0.2)  # the idle ones are gone: served again
    with connect(slow_server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_an_http_1_0_stream_is_close_delimited_not_chunked(slow_server):
    key = slow_server.keys["acme"]
    body = json.dumps({"model": slow_server.engine.model_name, "prompt": "hello", "max_tokens": 5,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    with connect(slow_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\nauthorization: Bearer "
                     + key.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
    events = [line[len(b"data: "):] for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
