"""Every request ends in exactly one ledger row: revoked keys stop at once on every replica, unclaimed records are written."""

from __future__ import annotations

import time

import anyio
import httpx
from sqlalchemy import select

from billing.keys import revoke_key
from billing.models import UsageEntry
from engine.request import EngineRequest, SamplingParams
from gateway.usage_recorder import RequestIdentity


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_key_revoked_by_the_cli_stops_working_on_every_replica_at_once(serve):
    replicas = [serve(auth_revocation_poll_s=0.2), serve(auth_revocation_poll_s=0.2)]
    key = replicas[0].add_tenant("acme", "premium")
    key_id = key.split("-")[1]
    auth = {"authorization": f"Bearer {key}"}
    assert [httpx.get(r.url + "/v1/models", headers=auth).status_code for r in replicas] == [200, 200]
    revoke_key(replicas[0].db, key_id)  # what `tiergate keys revoke` does, outside either replica
    revoked_at = time.monotonic()
    for replica in replicas:  # the cache TTL (5 s) alone would keep the key working that long
        assert _wait_for(lambda: httpx.get(replica.url + "/v1/models", headers=auth).status_code == 401, 1.5)
    assert time.monotonic() - revoked_at < 2.5


def test_a_request_driven_on_the_engine_directly_gets_its_ledger_row(serve):
    live = serve(ledger_checkpoint_s=0.1)
    request = EngineRequest("engine-direct-1", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    live.engine.generate_batch_sync([request])

    def row():
        with live.db.connect() as c:
            return c.execute(select(UsageEntry.tenant, UsageEntry.status, UsageEntry.completion_tokens)
                             .where(UsageEntry.request_id == "engine-direct-1")).all()

    assert _wait_for(lambda: row() == [(None, "ok", 4)], 5), row()


def test_a_finish_that_comes_after_its_request_gave_up_waiting_leaves_one_row(serve, monkeypatch):
    from gateway import usage_recorder as usage

    monkeypatch.setattr(usage, "FINISH_WAIT_S", 0.0)
    live = serve(ledger_checkpoint_s=0.1)
    recorder = live.gateway.usage
    late = RequestIdentity("late-1", "acme", "premium", None, time.time())
    fallback = usage.gateway_record(late, "cancelled", 3, 1, None)
    live.gateway.usage.meter.begin("late-1", "acme", "premium")
    anyio.run(recorder.finish, "late-1", fallback)  # gives up at once: the gateway's own account is written
    # The engine's finish event for it comes afterwards: nobody claims it; it must not make a second row.
    live.engine.generate_batch_sync([EngineRequest("late-1", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))])
    time.sleep(0.5)
    with live.db.connect() as c:
        rows = c.execute(select(UsageEntry.status).where(UsageEntry.request_id == "late-1")).all()
    assert rows == [("cancelled",)]
    assert recorder.meter.pop_unclaimed() == []  # written (and ignored), not piling up


def _ledger_rows(live, request_id: str) -> list[tuple]:
    with live.db.connect() as c:
        return c.execute(select(UsageEntry.status, UsageEntry.completion_tokens)
                         .where(UsageEntry.request_id == request_id)).all()


def test_a_non_streamed_request_gets_its_open_row_at_the_first_progress_save(serve):
    live = serve(ledger_checkpoint_s=600, ledger_orphan_after_s=1800)  # the test runs the save itself
    recorder = live.gateway.usage
    assert recorder.open(RequestIdentity("slow-1", "acme", "premium", None, time.time()), 3, lambda: 2, now=False) is None
    assert _ledger_rows(live, "slow-1") == []
    anyio.run(recorder._save_progress)
    assert _ledger_rows(live, "slow-1") == [("open", 2)]


def test_a_non_streamed_request_that_ends_before_a_save_writes_only_its_final_row(serve, monkeypatch):
    from gateway import usage_recorder as usage

    monkeypatch.setattr(usage, "FINISH_WAIT_S", 0.0)
    live = serve(ledger_checkpoint_s=600, ledger_orphan_after_s=1800)
    recorder = live.gateway.usage
    submitted: list[str] = []
    real_submit = recorder.ledger.submit
    monkeypatch.setattr(recorder.ledger, "submit", lambda records: submitted.extend(r.status for r in records)
                        or real_submit(records))
    quick = RequestIdentity("quick-1", "acme", "premium", None, time.time())
    recorder.open(quick, 3, lambda: 1, now=False)
    fallback = usage.gateway_record(quick, "ok", 3, 1, None)
    anyio.run(recorder.finish, "quick-1", fallback)
    anyio.run(recorder._save_progress)
    assert "open" not in submitted
    assert _ledger_rows(live, "quick-1") == [("ok", 1)]
