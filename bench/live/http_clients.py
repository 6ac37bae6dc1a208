"""Two one-connection HTTP/1.1 clients sending one fixed POST: a raw socket one (the least client work
per request, so a latency figure is the server's) and http.client, to compare with it."""

from __future__ import annotations

import http.client
import socket


class RawClient:
    """One keep-alive HTTP/1.1 connection sending a fixed POST: the least client work per request."""

    def __init__(self, port: int, path: str, headers: dict[str, str], body: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")
        data = body.encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "content-length": str(len(data))}.items())
        self.request = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n{head}\r\n".encode() + data

    def post(self) -> int:
        """Send the request, read the whole response; returns its status."""
        self.sock.sendall(self.request)
        status = int(self.reader.readline().split()[1])
        length = 0
        while (line := self.reader.readline()) != b"\r\n":
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        self.reader.read(length)
        return status

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class HttpClientPost:
    """The same POST through http.client, for comparison with RawClient."""

    def __init__(self, port: int, path: str, headers: dict[str, str], body: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.args = ("POST", path, body, headers)

    def post(self) -> int:
        self.conn.request(*self.args)
        response = self.conn.getresponse()
        response.read()
        return response.status

    def close(self) -> None:
        self.conn.close()
