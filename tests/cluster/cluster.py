"""A loopback cluster: `tiergate serve` replicas sharing Redis and one PostgreSQL schema, behind HAProxy.

HAProxy stands in for the Service and endpoint picker: it health-checks /readyz
(a draining replica leaves the rotation at once) and retries a request on
another replica when one answers 503 or cannot be reached, as a Gateway with
retries does. Every wait here is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from sqlalchemy import Engine, create_engine, text

REPO = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 420.0  # the bundled model on two busy cores
HEALTH_INTERVAL_MS = 300

HAPROXY_CONFIG = """\
global
    maxconn 512
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    timeout queue 30s
    timeout check 2s
    # A draining replica answers 503 and a stopped one refuses connections: try another one.
    retries 6
    option redispatch 1
    retry-on conn-failure empty-response 503
    option http-buffer-request
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter {interval}ms fastinter {interval}ms downinter {interval}ms fall 1 rise 1
frontend tiergate
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@dataclass
class Replica:
    name: str
    port: int
    env: dict[str, str]
    workdir: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"{self.name}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port)],
            cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        ok = wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout_s, 0.5)
        if not ok or self.proc.poll() is not None:
            raise AssertionError(f"{self.name} did not start:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / f"{self.name}-{self.starts}.log").read_text(errors="replace")[-3000:]

    def terminate(self, timeout_s: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class Cluster:
    workdir: Path
    replicas: list[Replica]
    proxy_port: int
    schema: str
    key_prefix: str
    db: Engine
    redis: redis.Redis
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key
    proxy: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def in_rotation(self) -> set[str]:
        """Replicas HAProxy would route to now (its health checks passed)."""
        return {r.name for r in self.replicas if r.ready()}

    def concurrency_leases(self, tenant: str) -> int:
        """The tenant's concurrency leases still in force (a lapsed one stays in the set until an admission)."""
        seconds, micros = self.redis.time()
        return self.redis.zcount(f"{self.key_prefix}:{{{tenant}}}:conc", f"({seconds + micros / 1e6}", "+inf")

    def ledger_rows(self, request_ids: list[str]) -> dict[str, list[tuple]]:
        """request id -> its ledger rows (status, completion tokens)."""
        rows: dict[str, list[tuple]] = {rid: [] for rid in request_ids}
        with self.db.connect() as c:
            for rid, status, tokens in c.execute(
                text("SELECT request_id, status, completion_tokens FROM usage_ledger WHERE request_id = ANY(:ids)"),
                {"ids": list(request_ids)},
            ):
                rows[rid].append((status, tokens))
        return rows

    def start_proxy(self) -> None:
        servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port} check" for r in self.replicas)
        config = self.workdir / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG.format(interval=HEALTH_INTERVAL_MS, port=self.proxy_port, servers=servers))
        log = open(self.workdir / "haproxy.log", "wb")
        self.proxy = subprocess.Popen([haproxy(), "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def up() -> bool:
            try:
                return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, 30), (self.workdir / "haproxy.log").read_text()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            self.proxy.wait(10)


def haproxy() -> str:
    found = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.path.exists(p)), None)
    if found is None:
        raise AssertionError("haproxy is not installed: `make haproxy` (Debian's package) installs it")
    return found


def create_schema() -> str:
    schema = f"tg_cluster_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    return schema


def drop_schema(schema: str) -> None:
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as c:
        c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


def schema_url(schema: str) -> str:
    return f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
