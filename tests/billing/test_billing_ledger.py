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
from billing.usage import UsageRecord

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
    from billing.usage import UsageRecord

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


@pytest.mark.parametrize("database_up", [True, False], ids=["database-up", "database-down"])
def test_sigkill_loses_no_row_whose_write_returned(outage, engine, tmp_path, database_up):
    spool = tmp_path / "spool.jsonl"
    if not database_up:
        outage.cut()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, outage.url, str(spool)],
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
