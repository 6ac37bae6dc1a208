"""The one-write HTTP protocol: a JSON answer leaves in one write; streams and HEAD answers are not held."""

from __future__ import annotations

import http.client
import json
import socket

from gateway.http_protocol import HeadHoldingTransport

JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_content_length_response_goes_out_in_one_write_with_its_body():
    inner = RecordingTransport()
    transport = HeadHoldingTransport(inner)
    transport.write(JSON_HEAD)
    assert inner.writes == []
    transport.write(b"{}")
    assert inner.writes == [JSON_HEAD + b"{}"]


def test_a_streams_head_is_written_at_once():
    inner = RecordingTransport()
    transport = HeadHoldingTransport(inner)
    transport.write(STREAM_HEAD)
    assert inner.writes == [STREAM_HEAD]
    transport.write(b"5\r\nhello\r\n")
    assert inner.writes == [STREAM_HEAD, b"5\r\nhello\r\n"]


def test_closing_after_a_held_head_still_sends_the_head_first():
    inner = RecordingTransport()
    transport = HeadHoldingTransport(inner)
    transport.write(JSON_HEAD)
    transport.close()
    assert inner.writes == [JSON_HEAD] and inner.closed


def test_other_transport_calls_reach_the_real_transport():
    inner = RecordingTransport()
    assert HeadHoldingTransport(inner).is_closing() is False


def _raw_response(port: int, request: bytes) -> bytes:
    """Everything the server sends for one request on a connection it then closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_live_server_answers_json_head_and_streams_through_it(server):
    port = int(server.url.rsplit(":", 1)[1])
    # GET: head and body, whole.
    answer = _raw_response(port, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
    # HEAD: uvicorn writes no body, so the head must not have been held back.
    answer = _raw_response(port, b"HEAD /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n")
    # A stream: chunked, its events and [DONE] arrive.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": server.engine.model_name, "prompt": "hi", "max_tokens": 3, "stream": True}),
                 {"authorization": f"Bearer {server.keys['acme']}", "content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("transfer-encoding") == "chunked"
    assert response.read().rstrip().endswith(b"data: [DONE]")


def test_an_http_1_0_chunked_response_is_written_unchunked():
    from gateway.http_protocol import CloseDelimitedTransport

    inner = RecordingTransport()
    transport = CloseDelimitedTransport(inner)
    transport.write(STREAM_HEAD)
    transport.write(b"5\r\nhello\r\n")
    transport.write(b"1\r\n!\r\n3\r\nabc\r\n0\r\n\r\n")
    transport.write(b"0\r\n\r\n")
    assert inner.writes == [STREAM_HEAD.replace(b"transfer-encoding: chunked\r\n", b""), b"hello", b"!abc"]


def test_an_http_1_0_content_length_response_passes_as_it_is():
    from gateway.http_protocol import CloseDelimitedTransport

    inner = RecordingTransport()
    CloseDelimitedTransport(inner).write(JSON_HEAD + b"{}")
    assert inner.writes == [JSON_HEAD + b"{}"]
