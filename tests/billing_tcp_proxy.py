"""A TCP proxy the tests can cut and restore, to take a database away from a client without stopping it."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)  # so the accept loop notices close()
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._up = True
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Drop every open connection and refuse new ones until restore()."""
        with self._lock:
            self._up = False
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            _close(s)

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._thread.join()
        self._server.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            with self._lock:
                up = self._up
            if not up:
                _close(client)
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
