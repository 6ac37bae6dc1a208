"""Ledger durability: one row per request through outages, replays and SIGKILL; none lost, none doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from billing.db import create_engine_for
from billing.ledger import Ledger
from billing.models import RecomputeCharge, UsageEntry
from billing.usage_record import UsageRecord

REPO = Path(__file__).resolve().parents[2]


def _record(request_id: str, **kw) -> UsageRecord:
    return UsageRecord(request_id=request_id, tenant="acme", tier="standard", adapter=None, status="ok",
                       queued_at=1_700_000_000.0, finished_at=1_700_000_001.0, gpu_seconds=0.25, **kw)


def _ledger_ids(engine) -> list[str]:
    with engine.connect() as c:
        return list(c.scalars(select(UsageEntry.request_id)))


def test_write_commits_the_row_and_its_recompute_charges(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    assert ledger.write(_record("a", recompute_by_tier={"premium": 0.5, "standard": 0.25}))
    with engine.connect() as c:
        row = c.execute(select(UsageEntry.request_id, UsageEntry.gpu_seconds, UsageEntry.recompute_gpu_seconds)).one()
        charges = dict(c.execute(select(RecomputeCharge.charged_tier, RecomputeCharge.gpu_seconds)).all())
    assert tuple(row) == ("a", 0.25, 0.75)
    assert charges == {"premium": 0.5, "standard": 0.25}
    assert not ledger.spool.pending()


def test_writing_a_request_twice_stores_it_once(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.write(_record("a", recompute_by_tier={"premium": 0.5}))
    ledger.write(_record("a", recompute_by_tier={"premium": 0.5}))
    ledger.spool.append(_record("a", recompute_by_tier={"premium": 0.5}))
    assert ledger.replay() == 0
    assert _ledger_ids(engine) == ["a"]
    with engine.connect() as c:
        assert c.scalar(select(func.count()).select_from(RecomputeCharge)) == 1


def test_outage_mid_run_loses_and_doubles_nothing(outage, engine, tmp_path):
    """The database goes away mid-run and comes back: the background replay fills the gap."""
    ledger = Ledger(create_engine_for(outage.url, connect_timeout_s=0.2), tmp_path / "spool.jsonl",
                    retry_interval_s=0.05)
    ledger.start()
    written = []
    for i in range(30):
        if i == 10:
            outage.cut()
        if i == 20:
            outage.restore()
        written.append(ledger.write(_record(f"req-{i}")))
    assert written[10:20] == [False] * 10 and all(written[:10]) and all(written[20:])
    deadline = time.monotonic() + 30
    while ledger.spool.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    ledger.close()
    ids = _ledger_ids(engine)
    assert sorted(ids) == sorted(f"req-{i}" for i in range(30))
    ledger.engine.dispose()


def test_spool_is_replayed_at_start(engine, tmp_path):
    Ledger(engine, tmp_path / "spool.jsonl").spool.append(_record("spooled"))
    with Ledger(engine, tmp_path / "spool.jsonl") as ledger:
        assert not ledger.spool.pending()
    assert _ledger_ids(engine) == ["spooled"]


def test_torn_spool_line_from_a_crash_is_skipped_and_later_rows_kept(engine, tmp_path):
    spool_path = tmp_path / "spool.jsonl"
    line = json.dumps(_record("whole").to_json())
    spool_path.write_text(line + "\n" + line[: len(line) // 2])  # a crash mid-append
    ledger = Ledger(engine, spool_path)
    ledger.spool.append(_record("after"))
    assert ledger.replay() == 2
    assert sorted(_ledger_ids(engine)) == ["after", "whole"]


WRITER = textwrap.dedent(
    """
    import sys
    from billing.db import create_engine_for
    from billing.ledger import Ledger
    from billing.usage_record import UsageRecord

    url, spool = sys.argv[1], sys.argv[2]
    ledger = Ledger(create_engine_for(url, connect_timeout_s=0.2), spool)
    i = 0
    while True:
        rid = f"kill-{i}"
        ledger.write(UsageRecord(rid, "acme", "standard", None, "ok", 1.7e9, 1.7e9 + 1, gpu_seconds=0.1))
        print(rid, flush=True)
        i += 1
    """
)


SUBMITTER = textwrap.dedent(
    """
    import sys
    from billing.db import create_engine_for
    from billing.ledger import Ledger
    from billing.usage_record import UsageRecord

    url, spool = sys.argv[1], sys.argv[2]
    ledger = Ledger(create_engine_for(url, connect_timeout_s=0.2), spool, retry_interval_s=0.2)
    ledger.start()
    i = 0
    while True:
        rid = f"kill-{i}"
        record = UsageRecord(rid, "acme", "standard", None, "ok", 1.7e9, 1.7e9 + 1, gpu_seconds=0.1)
        # The gateway's way: on the caller's thread when the ledger is quiet, else through the writer.
        ledger.write_now([record]) or ledger.submit([record]).result()
        print(rid, flush=True)
        i += 1
    """
)


@pytest.mark.parametrize("script", ["WRITER", "SUBMITTER"], ids=["write", "submit-or-write-now"])
@pytest.mark.parametrize("database_up", [True, False], ids=["database-up", "database-down"])
def test_sigkill_loses_no_row_whose_write_returned(outage, engine, tmp_path, database_up, script):
    spool = tmp_path / "spool.jsonl"
    if not database_up:
        outage.cut()
    writer = subprocess.Popen(
        [sys.executable, "-c", {"WRITER": WRITER, "SUBMITTER": SUBMITTER}[script], outage.url, str(spool)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    returned = [writer.stdout.readline().strip() for _ in range(15)]
    os.kill(writer.pid, signal.SIGKILL)
    returned += [line.strip() for line in writer.stdout]  # printed before the kill
    writer.wait()
    assert len(returned) >= 15 and all(returned)
    if not database_up:
        outage.restore()
    with Ledger(engine, spool):  # a restarted server replays the spool
        pass
    stored = _ledger_ids(engine)
    assert set(returned) <= set(stored) and len(stored) == len(set(stored))


def test_write_many_goes_to_the_spool_as_a_whole_while_the_database_is_down(outage, engine, tmp_path):
    ledger = Ledger(create_engine_for(outage.url, connect_timeout_s=0.2), tmp_path / "spool.jsonl")
    outage.cut()
    assert ledger.write_many([_record("m1"), _record("m2")]) is False
    outage.restore()
    assert ledger.write_many([_record("m2"), _record("m3")]) is True
    assert ledger.replay() == 1  # m2 came in with the second batch already
    assert sorted(_ledger_ids(engine)) == ["m1", "m2", "m3"]
    ledger.engine.dispose()


def test_submitted_records_are_group_committed_and_each_future_resolves_once_durable(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.start()
    try:
        futures = [ledger.submit([_record(f"g-{i}")]) for i in range(50)]
        futures.append(ledger.submit([_record("g-charged", recompute_by_tier={"premium": 0.5})]))
        assert all(f.result(timeout=30) is True for f in futures)
    finally:
        ledger.close()
    assert sorted(_ledger_ids(engine)) == sorted([f"g-{i}" for i in range(50)] + ["g-charged"])
    with engine.connect() as c:
        assert c.scalar(select(func.count()).select_from(RecomputeCharge)) == 1


def test_close_writes_what_was_submitted_before_it(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.start()
    futures = [ledger.submit([_record(f"c-{i}")]) for i in range(20)]
    ledger.close()
    assert all(f.done() and f.result() for f in futures)
    assert len(_ledger_ids(engine)) == 20
    # Without a writer, submit() writes before it returns.
    assert ledger.submit([_record("after-close")]).result(timeout=0) is True


def test_a_record_the_database_refuses_fails_only_its_own_future(engine, tmp_path):
    bad = _record("bad")
    object.__setattr__(bad, "status", "bogus")  # past UsageRecord's own check; the CHECK constraint refuses it
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.start()
    try:
        futures = [ledger.submit([_record("ok-1")]), ledger.submit([bad]), ledger.submit([_record("ok-2")])]
        assert futures[0].result(timeout=30) and futures[2].result(timeout=30)
        with pytest.raises(Exception):
            futures[1].result(timeout=30)
    finally:
        ledger.close()
    assert sorted(_ledger_ids(engine)) == ["ok-1", "ok-2"]


def test_write_now_commits_on_a_quiet_sqlite_ledger_only(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    assert ledger.write_now([_record("not-started")]) is False  # no writer: nothing written
    ledger.start()
    try:
        written = ledger.write_now([_record("now")])
        assert written is (engine.dialect.name == "sqlite")
        # Recompute charges take the writer's path, on every database.
        assert ledger.write_now([_record("charged", recompute_by_tier={"premium": 0.5})]) is False
    finally:
        ledger.close()
    assert _ledger_ids(engine) == (["now"] if written else [])
    if written:  # stored as SQLAlchemy's own inserts store it: the same values read back
        ledger.write(_record("orm"))
        with engine.connect() as c:
            rows = {r.request_id: r for r in c.execute(select(UsageEntry))}
        columns = [col.name for col in UsageEntry.__table__.columns if col.name not in ("id", "request_id")]
        assert [getattr(rows["now"], n) for n in columns] == [getattr(rows["orm"], n) for n in columns]


def test_write_now_declines_at_once_when_it_would_wait(outage, engine, tmp_path):
    """SQLite while another connection holds the write lock; PostgreSQL always (its rows go through submit)."""
    sqlite = outage.url.startswith("sqlite")
    ledger = Ledger(create_engine_for(outage.url, connect_timeout_s=5), tmp_path / "spool.jsonl")
    ledger.start()
    try:
        outage.cut()
        started = time.monotonic()
        assert ledger.write_now([_record("locked")]) is False
        assert time.monotonic() - started < 1.0  # the connection's timeout is 5 s: it did not wait
        outage.restore()
        assert ledger.write_now([_record("unlocked")]) is sqlite
    finally:
        ledger.close()
        ledger.engine.dispose()
    assert _ledger_ids(engine) == (["unlocked"] if sqlite else [])
