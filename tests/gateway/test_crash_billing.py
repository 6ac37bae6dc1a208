"""A `tiergate serve` killed mid-stream: the request's row, opened at admission, is closed as `interrupted` on restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.models import UsageEntry
from billing.tenants import create_tenant

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_S = 0.2


@pytest.fixture
def long_context_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with room for a stream long enough to be killed in the middle of."""
    d = tmp_path / "long-tiny"
    d.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    (d / "tokenizer_config.json").write_text((tiny_model_dir / "tokenizer_config.json").read_text())
    return d


def _serve(model_dir: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", f"dummy:{model_dir}", "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)


def _row(url: str, request_id: str) -> tuple[str, int]:
    engine = create_engine_for(url)
    try:
        with engine.connect() as c:
            rows = c.execute(select(UsageEntry.status, UsageEntry.completion_tokens)
                             .where(UsageEntry.request_id == request_id)).all()
    finally:
        engine.dispose()
    assert len(rows) == 1, rows
    return tuple(rows[0])


def test_a_stream_cut_by_sigkill_is_billed_as_interrupted_with_the_tokens_sent(tmp_path, long_context_model_dir,
                                                                                unused_port):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    upgrade(url)
    db = create_engine_for(url)
    create_tenant(db, "acme", "standard", rpm=1000)
    key = create_key(db, "acme")[1]
    db.dispose()
    env = {**os.environ, "TIERGATE_DATABASE_URL": url, "TIERGATE_SPOOL_PATH": str(tmp_path / "spool.jsonl"),
           "TIERGATE_LEDGER_CHECKPOINT_S": str(CHECKPOINT_S), "TIERGATE_MAX_MODEL_LEN": "8192"}
    proc = _serve(long_context_model_dir, unused_port, env)
    try:
        body = {"model": f"dummy:{long_context_model_dir}", "prompt": "go", "max_tokens": 8000,
                "ignore_eos": True, "stream": True, "logprobs": 0}
        with httpx.Client(timeout=60) as http:
            body["model"] = http.get(f"http://127.0.0.1:{unused_port}/v1/models",
                                     headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
            seen: list[tuple[float, int]] = []  # (when, tokens seen so far), counted by their logprobs
            with http.stream("POST", f"http://127.0.0.1:{unused_port}/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as stream:
                request_id = None
                for line in stream.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    request_id = chunk["id"]
                    logprobs = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
                    if logprobs and logprobs["tokens"]:
                        seen.append((time.monotonic(), (seen[-1][1] if seen else 0) + len(logprobs["tokens"])))
                    if seen and seen[-1][0] - seen[0][0] > 6 * CHECKPOINT_S:
                        proc.send_signal(signal.SIGKILL)
                        killed_at = time.monotonic()
                        break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert _row(url, request_id)[0] == "open"  # what the dead process left

    proc = _serve(long_context_model_dir, unused_port, env)
    try:
        status, tokens = _row(url, request_id)
    finally:
        proc.kill()
        proc.communicate()
    # Saved at most one checkpoint (plus the commit's own time) before the kill: at least what the
    # client had seen by then.
    seen_before = max((count for when, count in seen if when <= killed_at - 2 * CHECKPOINT_S), default=0)
    assert status == "interrupted"
    assert seen_before > 0 and seen_before <= tokens <= 8000
