"""Batches survive their replicas: a `tiergate serve` killed with SIGKILL mid-batch and started again, on SQLite
and on PostgreSQL, and three replicas behind HAProxy sharing one batch; each line is answered once in the
output file and billed once in the ledger."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import func, select

from billing.batch_models import BatchLine
from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.models import UsageEntry
from billing.tenants import create_tenant
from tests.cluster.cluster import (
    START_TIMEOUT_S,
    Cluster,
    Replica,
    create_schema,
    drop_schema,
    free_port,
    schema_url,
    wait_for,
)
from tests.gateway.both_databases import migrated_database

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 2.0  # short, so a killed replica's lines visibly come back within the test
# Rounds of 4 lines per replica: with several rounds left, the replica to kill is seen holding leases after its
# first answers however unevenly the three replicas run on a loaded machine.
LINES = 48


def replica_env(tiny_model_dir: Path, database_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TIERGATE_MODEL": f"dummy:{tiny_model_dir}",
        "TIERGATE_DATABASE_URL": database_url,
        "TIERGATE_BATCH_LEASE_S": str(LEASE_S),
        "TIERGATE_BATCH_WINDOW": "4",
        "TIERGATE_BATCH_POLL_S": "0.1",
        "TIERGATE_LOG_LEVEL": "warning",
    }


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    with migrated_database(request.param, tmp_path) as url:
        yield url


def tenant_key(database_url: str) -> str:
    db = create_engine_for(database_url)
    create_tenant(db, "acme", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    key = create_key(db, "acme")[1]
    db.dispose()
    return key


def start_batch(url: str, key: str, model: str) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=3)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"count to {i}", "max_tokens": 60, "temperature": 0,
                       "ignore_eos": True}} for i in range(LINES)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    return client, batch.id


def model_name(url: str, key: str) -> str:
    return httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]


def assert_each_line_once(client: openai.OpenAI, batch_id: str, database_url: str) -> None:
    done = client.batches.retrieve(batch_id)
    assert done.status == "completed", done
    assert done.request_counts.completed == LINES
    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{i}" for i in range(LINES))
    db = create_engine_for(database_url)
    with db.connect() as connection:
        rows = connection.execute(select(UsageEntry.custom_id, UsageEntry.status, UsageEntry.request_id)
                                  .where(UsageEntry.batch_id == batch_id)).all()
    db.dispose()
    assert Counter(r.custom_id for r in rows) == Counter(f"line-{i}" for i in range(LINES))
    assert {r.status for r in rows} == {"ok"}
    # The answer in the file is the attempt the ledger billed.
    billed = {r.custom_id: r.request_id for r in rows}
    assert all(line["response"]["request_id"] == billed[line["custom_id"]] for line in out)


def wait_completed(client: openai.OpenAI, batch_id: str, timeout_s: float = 300.0) -> None:
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed", timeout_s, 0.5), \
        client.batches.retrieve(batch_id)


def max_attempts(database_url: str, batch_id: str) -> int:
    db = create_engine_for(database_url)
    with db.connect() as connection:
        n = connection.execute(select(func.max(BatchLine.attempts)).where(BatchLine.batch_id == batch_id)).scalar()
    db.dispose()
    return n


def leased_by(database_url: str, batch_id: str, pid: int) -> int:
    """Lines of the batch leased by the process of this pid (a lease's owner is host/pid/token)."""
    db = create_engine_for(database_url)
    with db.connect() as connection:
        owners = connection.execute(select(BatchLine.lease_owner).where(BatchLine.batch_id == batch_id,
                                                                        BatchLine.state == "leased")).scalars().all()
    db.dispose()
    return sum(1 for owner in owners if owner and owner.split("/")[1] == str(pid))


def stopped_holding_leases(replica: Replica, database_url: str, batch_id: str) -> bool:
    """SIGSTOPs the replica and says whether it holds leases of the batch; continues it when it holds none."""
    replica.proc.send_signal(signal.SIGSTOP)
    if leased_by(database_url, batch_id, replica.proc.pid) > 0:
        return True
    replica.proc.send_signal(signal.SIGCONT)
    return False


def test_sigkill_mid_batch_then_restart_answers_and_bills_every_line_once(database, tiny_model_dir, tmp_path):
    key = tenant_key(database)
    replica = Replica("solo", free_port(), replica_env(tiny_model_dir, database), tmp_path)
    replica.start()
    try:
        replica.wait_ready(START_TIMEOUT_S)
        client, batch_id = start_batch(replica.url, key, model_name(replica.url, key))
        # Killed with some lines answered and others running. It is stopped before its leases are counted, so a
        # line seen leased cannot finish between the count and the kill.
        assert wait_for(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 4, 180, 0.1)
        assert wait_for(lambda: stopped_holding_leases(replica, database, batch_id), 30, 0.02)
        replica.proc.send_signal(signal.SIGKILL)
        replica.proc.wait(30)
        replica.start()
        replica.wait_ready(START_TIMEOUT_S)
        wait_completed(client, batch_id)
        assert_each_line_once(client, batch_id, database)
        assert max_attempts(database, batch_id) >= 2  # the lines the kill cut ran again after the restart
    finally:
        replica.stop()


@pytest.fixture
def three_replicas(tiny_model_dir, tmp_path):
    schema = create_schema()
    url = schema_url(schema)
    upgrade(url)
    db = create_engine_for(url)
    replicas = [Replica(f"r{i}", free_port(), replica_env(tiny_model_dir, url), tmp_path) for i in range(3)]
    cluster = Cluster(tmp_path, replicas, free_port(), schema, "unused", db, None)
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready(START_TIMEOUT_S)
        cluster.start_proxy()
        yield cluster, url
    finally:
        cluster.stop()
        db.dispose()
        drop_schema(schema)


def batch_lines_run(replica: Replica) -> float:
    text = httpx.get(replica.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('tiergate_requests_total{') and 'tier="batch"' in line)


def test_three_replicas_behind_haproxy_share_one_batch_and_answer_each_line_once(three_replicas):
    cluster, url = three_replicas
    key = tenant_key(url)
    client, batch_id = start_batch(cluster.url, key, model_name(cluster.url, key))
    # One replica dies mid-batch; the two others take its lines over once their leases run out.
    victim = cluster.replicas[0]
    # Killed once it has answered a line and holds others: those must be taken over (a replica killed between
    # its claims would leave nothing to take over, and the test would show nothing). It is stopped before its
    # leases are counted, so it cannot answer them between the count and the kill.

    assert wait_for(lambda: batch_lines_run(victim) >= 1 and stopped_holding_leases(victim, url, batch_id), 180, 0.05)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    assert leased_by(url, batch_id, victim.proc.pid) > 0
    wait_completed(client, batch_id)
    assert_each_line_once(client, batch_id, url)
    assert max_attempts(url, batch_id) >= 2  # the dead replica's lines were taken over
    assert all(batch_lines_run(r) >= 1 for r in cluster.replicas[1:])
