"""Faults to cause on purpose, for the tests and bench/live/chaos.py: a TCP proxy to cut, a redis-server to restart."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path


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
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the server behind is down itself: the client sees its connection closed
                _close(client)
                continue
            upstream.settimeout(None)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
