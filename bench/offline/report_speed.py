"""Report speed: a month of synthetic ledger rows (1M) in PostgreSQL, then the per-tier daily report, timed.

    .venv/bin/python -m bench.offline.report_speed [--rows N] [--keep]

Loads into a dedicated database (dropped afterwards unless --keep) through COPY, and prints
the report's time; the goal is under 2 s for 1M rows.
"""

from __future__ import annotations

import argparse
import io
import random
import time
import uuid
from datetime import datetime, timedelta

import psycopg
from sqlalchemy.engine import make_url

from billing.db import create_engine_for, upgrade
from billing.report_formats import render
from billing.reports import usage_report

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/test"
MONTH_START = datetime(2026, 1, 1)
MONTH = timedelta(days=31)
LEDGER_COLUMNS = (
    "request_id, tenant, tier, adapter, prompt_tokens, cached_tokens, completion_tokens, gpu_seconds, "
    "recompute_gpu_seconds, status, queued_at, first_token_at, finished_at"
)
CHUNK = 100_000
GOAL_S = 2.0
NULL = r"\N"  # COPY's text format for NULL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=DEFAULT_SERVER, help="a PostgreSQL URL to create the bench database from")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()

    server = make_url(args.server)
    name = f"tiergate_report_bench_{uuid.uuid4().hex[:8]}"
    _admin(server, f'CREATE DATABASE "{name}"')
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        started = time.perf_counter()
        charges = _load(server.set(database=name), args.rows)
        print(f"loaded {args.rows} ledger rows and {charges} recompute charges in {time.perf_counter() - started:.1f} s")
        engine = create_engine_for(url)
        timings = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            rows = usage_report(engine, MONTH_START, MONTH_START + MONTH, group_by="tier", bucket="day")
            timings.append(time.perf_counter() - started)
        engine.dispose()
        print(render(rows[:4], "table"), end="")
        print(f"... {len(rows)} report rows")
        verdict = "meets" if min(timings) < GOAL_S else "MISSES"
        print(
            f"per-tier daily report over {args.rows} rows: first {timings[0]:.3f} s, "
            f"best {min(timings):.3f} s of {args.repeat} ({verdict} the {GOAL_S:.0f} s goal)"
        )
    finally:
        if args.keep:
            print(f"kept database {name}")
        else:
            _admin(server, f'DROP DATABASE "{name}" WITH (FORCE)')


def _admin(server, statement: str) -> None:
    connection = _connect(server)
    connection.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction
    with connection.cursor() as cursor:
        cursor.execute(statement)
    connection.close()


def _connect(url):
    return psycopg.connect(
        host=url.host, port=url.port or 5432, user=url.username, password=url.password, dbname=url.database
    )


def _load(url, rows: int) -> int:
    """COPY `rows` synthetic requests spread over the month; returns the number of recompute charges."""
    rng = random.Random(0)
    # One tenant in four is premium.
    tenants = [(f"tenant-{i:03d}", "premium" if i % 4 == 0 else "standard") for i in range(200)]
    adapters = [None] * 4 + [f"adapter-{i}" for i in range(12)]
    statuses = ["ok"] * 90 + ["cancelled"] * 4 + ["error"] * 1 + ["rejected"] * 5
    month_s = MONTH.total_seconds()
    connection = _connect(url)
    charges = 0
    with connection, connection.cursor() as cursor:
        for first in range(0, rows, CHUNK):
            ledger, recompute = io.StringIO(), io.StringIO()
            for i in range(first, min(rows, first + CHUNK)):
                tenant, tier = rng.choice(tenants)
                status = rng.choice(statuses)
                finished = MONTH_START + timedelta(seconds=rng.random() * month_s)
                queued = finished - timedelta(seconds=rng.uniform(0.2, 30))
                served = status != "rejected"
                prompt, completion = rng.randint(16, 2048), rng.randint(1, 512) if served else 0
                gpu = (prompt * 2e-5 + completion * 4e-3) * rng.uniform(0.8, 1.2) if served else 0.0
                redo = gpu * rng.uniform(0.1, 0.5) if served and tier == "standard" and rng.random() < 0.05 else 0.0
                adapter = rng.choice(adapters) or NULL
                first_token = (queued + (finished - queued) * 0.1).isoformat(sep=" ") if served else NULL
                ledger.write(
                    f"bench-{i}\t{tenant}\t{tier}\t{adapter}\t{prompt}\t{prompt // 3}\t{completion}\t"
                    f"{gpu:.6f}\t{redo:.6f}\t{status}\t{queued.isoformat(sep=' ')}\t{first_token}\t"
                    f"{finished.isoformat(sep=' ')}\n"
                )
                if redo:
                    recompute.write(f"bench-{i}\tpremium\t{redo:.6f}\t{finished.isoformat(sep=' ')}\n")
                    charges += 1
            ledger.seek(0)
            recompute.seek(0)
            with cursor.copy(f"COPY usage_ledger ({LEDGER_COLUMNS}) FROM STDIN") as copy:
                copy.write(ledger.getvalue())
            with cursor.copy("COPY recompute_charges (request_id, charged_tier, gpu_seconds, finished_at) FROM STDIN") as copy:
                copy.write(recompute.getvalue())
        cursor.execute("ANALYZE usage_ledger")
        cursor.execute("ANALYZE recompute_charges")
    connection.close()
    return charges


if __name__ == "__main__":
    main()
