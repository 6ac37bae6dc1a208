"""Rows opened at admission: one row per request id whatever order its records come in, progress saved, orphans closed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import select, text

from billing.db import alembic_config, create_engine_for, upgrade
from billing.ledger import Ledger
from billing.models import RecomputeCharge, UsageEntry
from billing.open_rows import PROCESS_OWNER, Progress, close_orphans, save_progress
from billing.usage_record import UsageRecord

NOW = time.time()


def _open(request_id: str, owner: str = PROCESS_OWNER, at: float = NOW) -> UsageRecord:
    return UsageRecord(request_id, "acme", "premium", None, "open", at, at, prompt_tokens=7, owner=owner)


def _final(request_id: str, status: str = "ok", tokens: int = 5, **kw) -> UsageRecord:
    return UsageRecord(request_id, "acme", "premium", None, status, NOW, NOW + 1, prompt_tokens=7,
                       completion_tokens=tokens, gpu_seconds=0.5, **kw)


def _rows(engine) -> dict[str, tuple]:
    with engine.connect() as c:
        return {r.request_id: (r.status, r.completion_tokens, r.gpu_seconds)
                for r in c.execute(select(UsageEntry.request_id, UsageEntry.status, UsageEntry.completion_tokens,
                                          UsageEntry.gpu_seconds))}


def _dead_owner() -> str:
    """The owner name of a process of this host that has exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = PROCESS_OWNER.split("/")[0]
    return f"{host}/{int(child.stdout)}/feedbeef"


def test_a_final_record_closes_the_open_row_and_one_row_stays_whatever_the_order(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.write_many([_open("a"), _final("a")])  # the usual order
    ledger.write_many([_final("b"), _open("b")])  # the open record late (it went through the writer)
    ledger.write_many([_open("c"), _final("c", recompute_by_tier={"standard": 0.25})])
    ledger.write_many([_final("a", tokens=99), _final("c", tokens=99)])  # a record written twice
    assert _rows(engine) == {"a": ("ok", 5, 0.5), "b": ("ok", 5, 0.5), "c": ("ok", 5, 0.5)}
    with engine.connect() as c:
        assert c.execute(select(RecomputeCharge.request_id, RecomputeCharge.gpu_seconds)).all() == [("c", 0.25)]


def test_progress_is_saved_into_open_rows_only(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.write_many([_open("running"), _open("done"), _final("done")])
    save_progress(engine, [Progress("running", 12, 0.125), Progress("done", 40, 9.0)])
    assert _rows(engine) == {"running": ("open", 12, 0.125), "done": ("ok", 5, 0.5)}


def test_rows_of_a_dead_process_are_closed_as_interrupted_with_their_saved_progress(engine, tmp_path):
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    ledger.write_many([_open("dead", owner=_dead_owner()), _open("mine"),
                       _open("silent", owner="elsewhere/1/abcd", at=NOW - 600),
                       _open("alive-elsewhere", owner="elsewhere/2/abcd")])
    save_progress(engine, [Progress("dead", 30, 0.75)], now=NOW)
    with engine.begin() as c:  # a replica on another host that stopped saving ten minutes ago
        c.execute(text("UPDATE usage_ledger SET finished_at = :t WHERE request_id = 'silent'"),
                  {"t": UsageRecord("x", None, "s", None, "ok", NOW - 600, NOW - 600).ledger_values()["finished_at"]})
    assert close_orphans(engine, orphan_after_s=60, now=NOW) == 2
    assert close_orphans(engine, orphan_after_s=60, now=NOW) == 0
    rows = _rows(engine)
    assert rows["dead"] == ("interrupted", 30, 0.75)
    assert rows["silent"][0] == "interrupted"
    assert rows["mine"][0] == "open" and rows["alive-elsewhere"][0] == "open"
    # The truth, if it turns up later (a spool replayed), replaces the interruption; still one row.
    ledger.write(_final("dead", tokens=31))
    assert _rows(engine)["dead"] == ("ok", 31, 0.5)


def test_migrations_keep_the_ledger_and_its_charges_on_the_way_up_and_down(empty_db_url):
    upgrade(empty_db_url, "0001")
    engine = create_engine_for(empty_db_url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO usage_ledger (request_id, tenant, tier, adapter, prompt_tokens, cached_tokens, "
                           "completion_tokens, gpu_seconds, recompute_gpu_seconds, status, queued_at, finished_at) "
                           "VALUES ('old', 'acme', 'standard', NULL, 3, 0, 4, 0.5, 0.25, 'ok', :t, :t)"),
                      {"t": "2026-01-01 00:00:00"})
            c.execute(text("INSERT INTO recompute_charges VALUES ('old', 'premium', 0.25, :t)"),
                      {"t": "2026-01-01 00:00:00"})
        upgrade(empty_db_url)
        with engine.connect() as c:
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
            assert c.execute(text("SELECT status, completion_tokens, owner FROM usage_ledger")).one() == ("ok", 4, None)
            assert c.execute(text("SELECT request_id, gpu_seconds FROM recompute_charges")).one() == ("old", 0.25)
        with engine.begin() as c:
            cfg = alembic_config()
            cfg.attributes["connection"] = c
            command.downgrade(cfg, "0001")
        with engine.connect() as c:
            assert c.execute(text("SELECT status, completion_tokens FROM usage_ledger")).one() == ("ok", 4)
    finally:
        engine.dispose()


@pytest.mark.parametrize("status", ["open", "interrupted"])
def test_the_new_statuses_are_accepted_by_the_schema(engine, tmp_path, status):
    Ledger(engine, tmp_path / "spool.jsonl").write(_final("s", status=status))
    assert _rows(engine)["s"][0] == status
