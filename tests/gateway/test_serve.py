"""`tiergate serve` in a subprocess: it serves, and on SIGTERM it drains before it exits."""

from __future__ import annotations

import os
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


@pytest.fixture
def served(tmp_path, tiny_model_dir, unused_port):
    env = {
        **os.environ,
        "TIERGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'serve.db'}",
        "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"),
        "TIERGATE_DRAIN_TIMEOUT_S": "60",
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
    yield url, key, proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_sigterm_turns_readyz_503_refuses_new_work_and_finishes_in_flight_streams(served):
    url, key, proc = served
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
            assert refused.status_code == 503
            rest = list(lines)
        assert "data: [DONE]" in rest
    proc.wait(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM)
