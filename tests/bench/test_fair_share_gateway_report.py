"""The fair-share gateway bench's report: the server's side of each light request is read from the real ledger."""

from __future__ import annotations

import pytest

from billing.db import create_engine_for, upgrade
from billing.ledger import Ledger
from billing.usage_record import UsageRecord
from bench.live.fair_share import Light, _merge, server_ttfts, summarise


@pytest.fixture
def ledger_db(tmp_path):
    """A migrated SQLite ledger holding light and flood rows: light-1 waited 0.25 s for its first token."""
    db = tmp_path / "tiergate.db"
    url = f"sqlite:///{db}"
    upgrade(url)
    engine = create_engine_for(url)
    ledger = Ledger(engine, tmp_path / "spool.jsonl")
    start = 1_700_000_000.0
    for request_id, tenant, first_token_at in [("light-1", "light", start + 0.25), ("light-2", "light", start + 0.5),
                                               ("light-3", "light", None), ("flood-1", "flood", start + 9.0)]:
        assert ledger.write(UsageRecord(request_id=request_id, tenant=tenant, tier="standard", adapter=None,
                                        status="ok", queued_at=start, finished_at=start + 10,
                                        first_token_at=first_token_at))
    engine.dispose()
    return db


def test_server_ttfts_are_the_light_tenants_queue_to_first_token_by_request_id(ledger_db):
    assert server_ttfts(ledger_db) == pytest.approx({"light-1": 0.25, "light-2": 0.5})


def test_summary_joins_client_and_server_sides_by_request_id_and_counts_failures_as_sent(ledger_db):
    server = server_ttfts(ledger_db)
    measured = {"alone": [Light("light-1", 0.3)], "flood": [Light("light-2", 0.6), None, Light("unknown", 0.9)],
                "tokens_per_s": 10.0, "refused_in_window": 0, "preemptions": 0.0, "recomputed_tokens": 0.0}
    one = summarise(measured, server)
    assert (one["flood"]["sent"], one["flood"]["ok"]) == (3, 2)
    assert one["flood"]["ttfts"] == [0.6, 0.9]
    assert one["flood"]["server_ttfts"] == pytest.approx([0.5])  # "unknown" has no row
    merged = _merge([one, one])
    assert merged["p99_ratio"] == pytest.approx(merged["flood"]["ttft_p99_s"] / 0.3)
    assert merged["server_p99_ratio"] == pytest.approx(0.5 / 0.25)
