"""A `tiergate serve` killed mid-request: at restart its hold is settled from its ledger row, once."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import select

from billing.budgets import set_budget
from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.models import UsageEntry
from billing.tenants import create_tenant
from tests.gateway.test_crash_billing import _serve, long_context_model_dir  # noqa: F401 (a fixture)

REDIS_URL = "redis://127.0.0.1:6379/0"
ORPHAN_AFTER_S = 2.0

pytestmark = pytest.mark.redis


def _budget_state(prefix: str) -> tuple[float, float, int]:
    """(spent, held, holds) of the one budget state under ``prefix``."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        (name,) = list(client.scan_iter(f"{prefix}:*budget*"))
        state = client.hgetall(name)
    finally:
        client.close()
    return float(state[b"spent"]), float(state[b"held"]), sum(k.startswith(b"h:") for k in state)


def test_a_request_cut_by_sigkill_is_settled_from_its_row_when_the_server_restarts(tmp_path: Path,
                                                                                   long_context_model_dir,  # noqa: F811
                                                                                   unused_port):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    upgrade(url)
    db = create_engine_for(url)
    create_tenant(db, "acme", "standard", rpm=1000, tpm=10_000_000)
    set_budget(db, "acme", "tokens", 1_000_000)
    key = create_key(db, "acme")[1]
    prefix = f"test-budget-crash:{uuid.uuid4().hex}"
    env = {**os.environ, "TIERGATE_DATABASE_URL": url, "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"),
           "TIERGATE_LEDGER_CHECKPOINT_S": "0.2", "TIERGATE_LEDGER_ORPHAN_AFTER_S": str(ORPHAN_AFTER_S),
           "TIERGATE_MAX_MODEL_LEN": "8192", "TIERGATE_REDIS_URL": REDIS_URL, "TIERGATE_REDIS_KEY_PREFIX": prefix}
    headers = {"authorization": f"Bearer {key}"}
    base = f"http://127.0.0.1:{unused_port}"
    proc = _serve(long_context_model_dir, unused_port, env)
    try:
        model = httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]
        body = {"model": model, "prompt": "go", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        chunks = 0
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/completions", json=body,
                                                            headers=headers) as stream:
            assert stream.status_code == 200, stream.read()
            for line in stream.iter_lines():
                chunks += line.startswith("data: {")
                if chunks > 40:
                    time.sleep(0.5)  # a progress save or two
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    spent, held, holds = _budget_state(prefix)
    assert (spent, held, holds) == (0, 2 + 8000, 1)  # what the dead process left: its worst case, held

    proc = _serve(long_context_model_dir, unused_port, env)
    try:
        deadline = time.monotonic() + 30
        while _budget_state(prefix)[2] and time.monotonic() < deadline:
            time.sleep(0.2)
        with db.connect() as c:
            status, prompt, completion = c.execute(select(UsageEntry.status, UsageEntry.prompt_tokens,
                                                          UsageEntry.completion_tokens)).one()
        assert status == "interrupted" and completion > 0
        assert _budget_state(prefix) == (prompt + completion, 0, 0)
        (budget,) = httpx.get(f"{base}/v1/usage", headers=headers).json()["budgets"]
        assert (budget["spent"], budget["reserved"]) == (prompt + completion, 0)
    finally:
        proc.kill()
        proc.communicate()
        db.dispose()
