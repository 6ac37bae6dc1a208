"""One spool file per process, and the files of processes that ended are replayed by the next one."""

from __future__ import annotations

import gc
import os
import time

from billing.spool import Spool, adopt_orphans, process_spool_path
from billing.usage_record import UsageRecord


def record(request_id: str) -> UsageRecord:
    now = time.time()
    return UsageRecord(request_id=request_id, tenant="t", tier="premium", adapter=None, status="ok",
                       queued_at=now, finished_at=now)


def test_the_default_spool_path_names_this_process(tmp_path):
    path = process_spool_path(tmp_path)
    assert path.parent == tmp_path and str(os.getpid()) in path.name


def test_orphaned_spools_are_adopted_and_live_ones_left_alone(tmp_path):
    dead = Spool(tmp_path / "ledger-host-1.jsonl")
    dead.append_many([record("a"), record("b")])
    del dead
    gc.collect()  # its lock goes with it, as with a process that ended
    alive = Spool(tmp_path / "ledger-host-2.jsonl")
    alive.append(record("c"))
    mine = Spool(tmp_path / "ledger-host-3.jsonl")

    assert adopt_orphans(mine) == 2
    assert sorted(r.request_id for r in mine.claim()) == ["a", "b"]
    assert not (tmp_path / "ledger-host-1.jsonl").exists()
    assert [r.request_id for r in alive.claim()] == ["c"]  # its owner lives: untouched
