"""A PostgreSQL outage (the connection cut by a TCP proxy): known keys keep working, nothing is a 500, no row is lost."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.support.faults import TcpProxy, free_port
from sqlalchemy import create_engine, select, text

from billing.db import create_engine_for, upgrade
from billing.models import UsageEntry

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[2]

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
ADMIN_HEADERS = {"authorization": "Bearer test-admin-token"}


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.fixture
def pg_proxy() -> Iterator[tuple[str, TcpProxy]]:
    """A fresh schema and a proxy in front of PostgreSQL: (the schema's URL through the proxy, the proxy)."""
    schema = f"tg_outage_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    proxy = TcpProxy("127.0.0.1", 5432)
    yield f"postgresql://postgres@127.0.0.1:{proxy.port}/test?options=-csearch_path%3D{schema}", proxy
    proxy.close()
    with admin.connect() as c:
        c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def database_url(pg_proxy) -> str:
    """The gateway fixtures' database: PostgreSQL through the proxy, not yet migrated."""
    return pg_proxy[0]


def _post(conn: http.client.HTTPConnection, path: str, key: str, body: dict = BODY) -> tuple[int, dict, dict]:
    conn.request("POST", path, json.dumps(body), {"authorization": f"Bearer {key}", "content-type": "application/json"})
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def _ledger(url: str) -> dict[str, str]:
    engine = create_engine_for(url)
    try:
        with engine.connect() as c:
            return dict(c.execute(select(UsageEntry.request_id, UsageEntry.status)).all())
    finally:
        engine.dispose()


def test_during_an_outage_seen_keys_work_unknown_keys_get_503_and_rows_arrive_after(serve, pg_proxy):
    url, proxy = pg_proxy
    upgrade(url)
    live = serve(auth_cache_ttl_s=0.2)
    model = live.engine.model_name
    seen = live.add_tenant("acme", "premium", rpm=10_000)
    unseen = live.add_tenant("globex", "standard", rpm=10_000)
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {**BODY, "model": model}
    status, _, first = _post(conn, "/v1/completions", seen, body)
    assert status == 200
    socket_before = conn.sock

    proxy.cut()
    time.sleep(0.5)  # the cache entry's TTL is over: only stale-if-error can serve it now
    answers = [_post(conn, "/v1/completions", seen, body) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 200]
    status, headers, error = _post(conn, "/v1/completions", unseen, body)
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert error["error"]["code"] == "service_unavailable" and error["error"]["type"] == "server_error"
    conn.request("GET", "/admin/tenants", headers=ADMIN_HEADERS)
    admin = conn.getresponse()
    assert admin.status == 503 and json.loads(admin.read())["error"]["code"] == "service_unavailable"
    assert conn.sock is socket_before  # every answer kept the connection open

    proxy.restore()
    ids = [first["id"]] + [a[2]["id"] for a in answers]
    # The rows written during the outage waited in the spool; the ledger writes them when it is back.
    assert wait_until(lambda: _ledger(url) == {i: "ok" for i in ids}, timeout_s=20), _ledger(url)
    # A client that honours Retry-After gets in once the database answers.
    for _ in range(5):
        status, headers, answer = _post(conn, "/v1/completions", unseen, body)
        if status != 503:
            break
        time.sleep(int(headers["retry-after"]))
    assert status == 200, answer
    conn.close()


def test_serve_starts_with_the_database_down_and_becomes_ready_once_it_answers(serve, pg_proxy):
    url, proxy = pg_proxy
    proxy.cut()
    live = serve(prepare_database=lambda: upgrade(url))
    assert httpx.get(live.url + "/healthz").status_code == 200
    ready = httpx.get(live.url + "/readyz")
    assert ready.status_code == 503 and "retry-after" in ready.headers
    refused = httpx.post(live.url + "/v1/completions", json=BODY, headers={"authorization": "Bearer tg-abc-def"})
    assert refused.status_code == 503 and "retry-after" in refused.headers

    proxy.restore()
    assert wait_until(lambda: httpx.get(live.url + "/readyz").status_code == 200, timeout_s=20)
    # Migrations ran once it answered: the gateway's own tables are there and serve.
    key = live.add_tenant("acme", "premium")
    done = httpx.post(live.url + "/v1/completions", json={**BODY, "model": live.engine.model_name},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert done.status_code == 200
    assert wait_until(lambda: _ledger(url) == {done.json()["id"]: "ok"}, timeout_s=10), _ledger(url)


def test_tiergate_serve_demo_waits_for_the_database_then_migrates_and_seeds(pg_proxy, tiny_model_dir, tmp_path):
    url, proxy = pg_proxy
    port = free_port()
    env = {**os.environ, "TIERGATE_DATABASE_URL": url, "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"),
           "PYTHONPATH": str(REPO)}
    proxy.cut()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--demo", "--model",
                             f"dummy:{tiny_model_dir}", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _status(base + "/healthz") == 200, timeout_s=120), "serve did not start"
        assert _status(base + "/readyz") == 503
        proxy.restore()
        assert wait_until(lambda: _status(base + "/readyz") == 200, timeout_s=30)
        engine = create_engine_for(url)
        with engine.connect() as c:
            tenants = sorted(c.scalars(text("SELECT name FROM tenants")))
        engine.dispose()
        assert tenants == ["acme", "globex"]  # the demo's tenants, made once the database answered
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert "tiergate demo" in out and "key: tg-" in out  # the banner, with keys that now exist


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None
