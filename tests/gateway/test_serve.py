"""`tiergate serve` in a subprocess: it serves, and on SIGTERM it drains before it exits (status 0)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.tenants import create_tenant

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["60"])
def served(request, tmp_path, tiny_model_dir, unused_port):
    env = {
        **os.environ,
        "TIERGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}",
        "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"),
        "TIERGATE_DRAIN_TIMEOUT_S": request.param,
    }
    db = create_engine_for(env["TIERGATE_DATABASE_URL"])
    upgrade(env["TIERGATE_DATABASE_URL"])
    create_tenant(db, "acme", "standard", rpm=1000)
    key = create_key(db, "acme")[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", f"dummy:{tiny_model_dir}", "--port",
         str(unused_port)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{unused_port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    yield url, key, proc, db
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_sigterm_turns_readyz_503_refuses_new_work_and_finishes_in_flight_streams(served):
    url, key, proc, _ = served
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        model = http.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": "drain me", "max_tokens": 400, "stream": True}
        with http.stream("POST", url + "/v1/completions", json=body, headers=auth) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            assert http.get(url + "/readyz").status_code == 503
            refused = http.post(url + "/v1/completions", json={**body, "stream": False}, headers=auth)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            rest = list(lines)
        assert "data: [DONE]" in rest
    proc.wait(timeout=60)
    assert proc.returncode == 0


@pytest.mark.parametrize("served", ["0"], indirect=True)  # no drain time: deterministic on any machine
def test_a_stream_running_at_the_drain_deadline_ends_with_a_shutdown_error_and_an_interrupted_row(served):
    url, key, proc, db = served
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        model = http.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": "go on", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with http.stream("POST", url + "/v1/completions", json=body, headers=auth) as stream:
            request_id = stream.headers["x-request-id"]
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)  # the role chunk, then the first text
            proc.send_signal(signal.SIGTERM)
            events = [line.removeprefix("data: ") for line in lines]
    proc.wait(timeout=60)
    assert proc.returncode == 0
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_shutdown" and "[DONE]" not in events
    sent = int(re.search(r"after (\d+) token", last["error"]["message"]).group(1))
    with db.connect() as c:
        rows = c.exec_driver_sql("SELECT status, completion_tokens FROM usage_ledger WHERE request_id = ?",
                                 (request_id,)).all()
    assert rows == [("interrupted", sent)] and 0 < sent < 500
