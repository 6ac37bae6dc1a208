"""A batch's intake on SQLite and PostgreSQL: created ``validating`` and validated afterwards by a driver (also
one left half-validated by a replica that died), the tenant's own queue limit, and the attempt cap of a line
whose runs keep failing."""

from __future__ import annotations

import json
import time

import openai
import pytest
from sqlalchemy import insert, select

from billing import batch_files, batch_intake, batch_lines, batches
from billing import tenants as billing_tenants
from billing.batch_models import Batch, BatchLine
from billing.db import create_engine_for
from billing.models import UsageEntry
from gateway import batch_driver
from gateway.batch_run import LineInterrupted
from tests.gateway.both_databases import database_url  # noqa: F401 (a fixture: these run on both databases)
from tests.gateway.test_batch_api import CHAT, chat_line, client_for, jsonl, output_lines, upload, wait_for


TENANT = {"rpm": 100_000, "tpm": 100_000_000, "max_concurrent": 1000}


def test_create_returns_validating_and_a_later_poll_sees_the_batch_run(serve):
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme", "premium", **TENANT)
    client = client_for(live)
    file = upload(client, jsonl([chat_line(f"l{i}", f"q{i}", live.engine.model_name) for i in range(3)]))
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert created.status == "validating" and created.in_progress_at is None and created.errors is None
    done = wait_for(client, created.id)
    assert done.status == "completed" and done.in_progress_at >= done.created_at
    assert sorted(line["custom_id"] for line in output_lines(client, done.output_file_id)) == ["l0", "l1", "l2"]


def test_a_bad_line_is_found_after_create_returned_and_named_in_errors(serve):
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme", "premium", **TENANT)
    client = client_for(live)
    model = live.engine.model_name
    file = upload(client, jsonl([chat_line("a", "fine", model), chat_line("b", "x", model),
                                 chat_line("a", "x", model)]))
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert created.status == "validating"
    failed = wait_for(client, created.id)
    assert failed.status == "failed" and failed.request_counts.total == 3
    [error] = failed.errors.data
    assert (error.line, error.code) == (3, "duplicate_custom_id")
    with live.db.connect() as connection:  # the lines that passed were stored, then dropped with the failure
        assert connection.execute(select(BatchLine.line).where(BatchLine.batch_id == created.id)).all() == []


def test_a_batch_left_validating_by_a_dead_replica_is_validated_by_the_next_start(serve, database_url):
    db = create_engine_for(database_url)
    billing_tenants.create_tenant(db, "acme", "premium", **TENANT)
    lines = [chat_line(f"l{i}", f"q{i}", "placeholder") for i in range(4)]
    live = serve(batch_poll_s=0.05, batch_lease_s=1.0)
    for line in lines:
        line["body"]["model"] = live.engine.model_name
    # Before this replica's driver can see it: a batch a dead replica claimed for validation and half stored.
    file = batch_files.store_file(db, "acme", "batch", "in.jsonl", [jsonl(lines)], lambda: 4)
    batch = batches.create_batch(db, "acme", CHAT, file.id, "24h", None, 4, 3600)
    with db.begin() as connection:  # as claim_validation and add_lines of the dead replica left it
        connection.execute(Batch.__table__.update().where(Batch.id == batch.id).values(
            validation_owner="dead/1/x", validation_until=time.time() + 2.0))
        connection.execute(insert(BatchLine).values(batch_id=batch.id, line=1, custom_id="l0", body="{}",
                                                    state="queued", attempts=0))
    live.add_tenant("acme")
    client = client_for(live)
    assert client.batches.retrieve(batch.id).status == "validating"
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 4
    out = output_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in out) == ["l0", "l1", "l2", "l3"]
    assert all(line["response"]["status_code"] == 200 for line in out)
    db.dispose()


def hold_tokens(db, tenant: str, tokens: int) -> str:
    """An unfinished batch of ``tenant`` holding ``tokens``: in progress, its one line running on another replica."""
    batch_id, now = batches.new_batch_id(), int(time.time())
    with db.begin() as connection:
        connection.execute(insert(Batch).values(
            id=batch_id, tenant=tenant, endpoint=CHAT, input_file_id="file-x", completion_window="24h",
            status="in_progress", total=1, reserved_tokens=tokens, created_at=now, in_progress_at=now,
            expires_at=now + 3600))
        connection.execute(insert(BatchLine).values(batch_id=batch_id, line=1, custom_id="held", body="{}",
                                                    state="leased", lease_owner="elsewhere/1/x",
                                                    lease_until=time.time() + 3600, attempts=1))
    return batch_id


def test_create_is_a_429_while_the_tenants_unfinished_batches_hold_its_own_limit(serve):
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme", "premium", batch_queue_tokens=1000, **TENANT)
    live.add_tenant("globex", "premium", **TENANT)  # the default limit: acme's full queue is not its business
    hold_tokens(live.db, "acme", 1000)
    hold_tokens(live.db, "globex", 1000)
    model = live.engine.model_name
    acme, globex = client_for(live, "acme"), client_for(live, "globex")
    file = upload(acme, jsonl([chat_line("a", "q", model)]))
    with pytest.raises(openai.RateLimitError) as e:
        acme.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert e.value.body["code"] == "batch_token_limit_exceeded" and "1000" in e.value.body["message"]
    other = globex.batches.create(input_file_id=upload(globex, jsonl([chat_line("a", "q", model)])).id,
                                  endpoint=CHAT, completion_window="24h")
    assert wait_for(globex, other.id).status == "completed"
    # The limit is the tenant's setting, read at each creation: raised, the same file goes in.
    billing_tenants.set_tenant(live.db, "acme", batch_queue_tokens=1_000_000)
    batch = acme.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert wait_for(acme, batch.id).status == "completed"


def test_a_batch_whose_lines_do_not_fit_the_tenants_limit_fails_validation_with_the_limit_code(serve):
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme", "premium", batch_queue_tokens=50, **TENANT)
    client = client_for(live)
    file = upload(client, jsonl([chat_line(f"l{i}", "a long enough question", live.engine.model_name)
                                 for i in range(5)]))
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert created.status == "validating"
    failed = wait_for(client, created.id)
    assert failed.status == "failed"
    [error] = failed.errors.data
    assert error.code == "batch_token_limit_exceeded" and "limit of 50" in error.message


def run_with_faults(monkeypatch, faults: dict[str, list[BaseException]]) -> dict[str, int]:
    """Patch the driver's run of a line: each run of a custom_id in ``faults`` raises the next exception listed (then
    runs for real); returns the runs counted per custom_id."""
    real, runs = batch_driver.run_line, {}

    async def run_line(gw, line, tenant, on_start=None):
        runs[line.custom_id] = runs.get(line.custom_id, 0) + 1
        queue = faults.get(line.custom_id, [])
        if queue:
            raise queue.pop(0)
        return await real(gw, line, tenant, on_start=on_start)

    monkeypatch.setattr(batch_driver, "run_line", run_line)
    return runs


def test_a_line_whose_runs_keep_failing_is_tried_five_times_then_written_to_the_error_file(serve, monkeypatch):
    runs = run_with_faults(monkeypatch, {"doomed": [RuntimeError("engine fault")] * 20,
                                         "shy": [LineInterrupted("stopping")] * 7})
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme", "premium", **TENANT)
    client = client_for(live)
    model = live.engine.model_name
    batch = client.batches.create(input_file_id=upload(client, jsonl([
        chat_line("fine", "q", model), chat_line("doomed", "q", model), chat_line("shy", "q", model)])).id,
        endpoint=CHAT, completion_window="24h")
    done = wait_for(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert runs["doomed"] == batch_driver.MAX_ATTEMPTS
    # Interruptions (a stopping replica, a 429 before the engine had it) are not failed runs: shy ran an 8th time.
    assert runs["shy"] == 8
    assert sorted(line["custom_id"] for line in output_lines(client, done.output_file_id)) == ["fine", "shy"]
    [error] = output_lines(client, done.error_file_id)
    assert error["custom_id"] == "doomed" and error["response"]["status_code"] == 500
    body = error["response"]["body"]["error"]
    assert body["code"] == "batch_line_failed" and "5 times" in body["message"]
    with live.db.connect() as connection:
        attempts = dict(connection.execute(select(BatchLine.custom_id, BatchLine.attempts)
                                           .where(BatchLine.batch_id == batch.id)).all())
        billed = connection.execute(select(UsageEntry.custom_id, UsageEntry.status)
                                    .where(UsageEntry.batch_id == batch.id)).all()
    assert attempts["doomed"] == 5 and attempts["shy"] == 1
    assert sorted(billed) == [("doomed", "rejected"), ("fine", "ok"), ("shy", "ok")]


def test_a_line_whose_replicas_died_five_times_is_answered_with_the_error_unrun(serve, database_url, monkeypatch):
    runs = run_with_faults(monkeypatch, {})
    db = create_engine_for(database_url)
    billing_tenants.create_tenant(db, "acme", "premium", **TENANT)
    file = batch_files.store_file(db, "acme", "batch", "in.jsonl", [b'{"x": 1}\n'], lambda: 1)
    batch = batches.create_batch(db, "acme", CHAT, file.id, "24h", None, 1, 3600)
    owner = "validator/1/x"
    assert batch_intake.claim_validation(db, owner, 30.0).id == batch.id
    spec = batches.LineSpec(1, "crashy", json.dumps(chat_line("crashy", "q", "m")["body"]), 10)
    assert batch_intake.add_lines(db, owner, batch.id, [spec], 30.0)
    assert batch_intake.finish_validation(db, owner, batch.id, [], 1, 10) == "in_progress"
    now = time.time() - 100
    for died in range(5):  # five replicas claimed it and died mid-run: each lease ran out
        [claimed] = batch_lines.claim(db, f"dead/{died}/x", 1, 1.0, now=now + 10 * died)
        assert claimed.attempts == died + 1
    db.dispose()
    live = serve(batch_poll_s=0.05)
    live.add_tenant("acme")
    client = client_for(live)
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.failed == 1
    [error] = output_lines(client, done.error_file_id)
    assert error["custom_id"] == "crashy" and error["response"]["body"]["error"]["code"] == "batch_line_failed"
    assert runs == {}
