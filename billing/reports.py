"""Usage reports from the ledger: requests, tokens, GPU-seconds, queue time and cost per bucket and tier/tenant/adapter.

Grouped by tier, recompute_gpu_seconds is the recompute charged to that tier (it preempted) and
is part of its cost. Grouped by tenant or adapter it is the recompute performed on the group's
requests, shown but not in their cost: the payer of recompute is a tier, not a tenant.
queue_seconds is the time the group's requests waited in the engine's queue, so a report by tenant
shows who waited behind whom.
Buckets are in UTC; the range is [start, end).

Money: ``cost`` is GPU-hours at the per-tier rates of TIERGATE_PRICES (recompute included, by
payer, as above); ``gpu_usd``, ``token_usd`` and ``usd`` price each row's own GPU-seconds and
tokens at the prices table's rates in effect at its ``finished_at`` (billing.prices), the way
budgets and /v1/usage price them, so the same rows cost the same there and here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime, time
from typing import Any

from sqlalchemy import Engine, case, func, literal_column, select
from sqlalchemy.orm import Session

from billing.db import create_engine_for
from billing.errors import InvalidReport, MissingPrice
from billing.models import RecomputeCharge, UsageEntry
from billing.prices import PriceBook, load_price_book
from billing.spend import interval_case
from tiergate_common.env import PRICES

GROUPS = ("tier", "tenant", "adapter")
BUCKETS = ("hour", "day")
# Price of one GPU-hour per tier; premium pays 3x standard unless configured otherwise, and batch
# (spare capacity, its recompute after a preemption included) half of standard, as OpenAI's Batch API.
DEFAULT_PRICES = {"standard": 2.0, "premium": 6.0, "batch": 1.0}
_SQLITE_BUCKET_FORMATS = {"hour": "%Y-%m-%d %H:00:00", "day": "%Y-%m-%d 00:00:00"}


@dataclass(frozen=True)
class ReportRow:
    bucket: datetime
    group: str | None  # None: requests with no tenant (engine-internal) or no adapter
    requests: int  # served requests: ok, cancelled or error
    rejected: int
    prompt_tokens: int
    completion_tokens: int
    gpu_seconds: float
    recompute_gpu_seconds: float
    queue_seconds: float
    cost: float
    gpu_usd: float = 0.0
    token_usd: float = 0.0
    usd: float = 0.0


@dataclass
class _Totals:
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    recompute_gpu_seconds: float = 0.0
    queue_seconds: float = 0.0
    cost: float = 0.0
    gpu_usd: float = 0.0
    token_usd: float = 0.0
    usd: float = 0.0


def default_prices() -> dict[str, float]:
    """TIERGATE_PRICES (e.g. "standard=2,premium=6", per GPU-hour), else DEFAULT_PRICES."""
    text = PRICES.get()
    return parse_prices(text) if text else dict(DEFAULT_PRICES)


def parse_prices(text: str) -> dict[str, float]:
    """Prices per GPU-hour from text like "standard=2,premium=6"."""
    prices = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tier, _, value = (x.strip() for x in part.partition("="))
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not tier or not math.isfinite(price) or price < 0:
            raise InvalidReport(f"prices must look like 'standard=2,premium=6', got {text!r}")
        prices[tier] = price
    if not prices:
        raise InvalidReport(f"prices must look like 'standard=2,premium=6', got {text!r}")
    return prices


def usage_report(
    db: Engine | Session | str,
    start: datetime | date,
    end: datetime | date,
    group_by: str = "tier",
    bucket: str = "day",
    prices: Mapping[str, float] | None = None,
    price_book: PriceBook | None = None,
) -> list[ReportRow]:
    """Ledger totals of [start, end) per bucket and group, sorted; `prices` are per GPU-hour and tier,
    `price_book` the prices table (read from the database when None)."""
    if group_by not in GROUPS:
        raise InvalidReport(f"group_by must be one of {', '.join(GROUPS)}, got {group_by!r}")
    if bucket not in BUCKETS:
        raise InvalidReport(f"bucket must be one of {', '.join(BUCKETS)}, got {bucket!r}")
    start, end = _utc(start), _utc(end)
    if end <= start:
        raise InvalidReport(f"the report's end ({end}) must be after its start ({start})")
    prices = default_prices() if prices is None else prices
    if isinstance(db, Session):
        book = price_book if price_book is not None else load_price_book(db.get_bind())
        return _report(db, start, end, group_by, bucket, prices, book)
    engine = create_engine_for(db) if isinstance(db, str) else db
    try:
        book = price_book if price_book is not None else load_price_book(engine)
        with Session(engine) as session:
            return _report(session, start, end, group_by, bucket, prices, book)
    finally:
        if isinstance(db, str):
            engine.dispose()


def _report(
    session: Session, start: datetime, end: datetime, group_by: str, bucket: str, prices: Mapping[str, float],
    book: PriceBook,
) -> list[ReportRow]:
    dialect = session.get_bind().dialect.name
    ledger = UsageEntry.__table__.c
    when = _bucket(dialect, bucket, ledger.finished_at)
    group = ledger[group_by]
    # Grouping by tier too (whatever the report groups by) lets cost use each row's tier price.
    keys = (when, group) if group_by == "tier" else (when, group, ledger.tier)
    # Split where a price changes, so each piece of a bucket is priced at one rate per tier.
    pieces = [start, *book.changes_within(start, end), end]
    piece = interval_case(ledger.finished_at, pieces).label("piece")
    usage = session.execute(
        select(
            when,
            group.label("grp"),
            ledger.tier.label("tier"),
            piece,
            func.sum(case((ledger.status == "rejected", 0), else_=1)),
            func.sum(case((ledger.status == "rejected", 1), else_=0)),
            func.sum(ledger.prompt_tokens),
            func.sum(ledger.completion_tokens),
            func.sum(ledger.gpu_seconds),
            func.sum(ledger.recompute_gpu_seconds),
            func.sum(ledger.queue_seconds),
        )
        .where((ledger.finished_at >= start) & (ledger.finished_at < end))
        .group_by(*keys, piece)
    )
    totals: dict[tuple[Any, str | None], _Totals] = defaultdict(_Totals)
    for when_value, group_value, tier, piece_index, served, rejected, prompt, completion, gpu, recompute, queued in usage:
        t = totals[when_value, group_value]
        t.queue_seconds += queued
        t.requests += served
        t.rejected += rejected
        t.prompt_tokens += prompt
        t.completion_tokens += completion
        t.gpu_seconds += gpu
        t.cost += gpu * _price(prices, tier) / 3600
        rate = book.at(tier, pieces[piece_index])
        t.gpu_usd += rate.cost(gpu, 0, 0)
        t.token_usd += rate.cost(0.0, prompt, completion)
        t.usd = t.gpu_usd + t.token_usd
        if group_by != "tier":
            t.recompute_gpu_seconds += recompute
    if group_by == "tier":
        charges = RecomputeCharge.__table__.c
        charged_when = _bucket(dialect, bucket, charges.finished_at)
        charged = session.execute(
            select(charged_when, charges.charged_tier, func.sum(charges.gpu_seconds))
            .where((charges.finished_at >= start) & (charges.finished_at < end))
            .group_by(charged_when, charges.charged_tier)
        )
        for when_value, tier, seconds in charged:
            t = totals[when_value, tier]
            t.recompute_gpu_seconds += seconds
            t.cost += seconds * _price(prices, tier) / 3600
    rows = [
        ReportRow(_as_datetime(when_value), group_value, **asdict(t))
        for (when_value, group_value), t in totals.items()
    ]
    return sorted(rows, key=lambda r: (r.bucket, r.group is None, r.group or ""))


def _bucket(dialect: str, bucket: str, column):
    if dialect == "postgresql":
        # A literal, not a bind parameter, so SELECT and GROUP BY hold the very same expression.
        return func.date_trunc(literal_column(f"'{bucket}'"), column)
    if dialect == "sqlite":
        return func.strftime(literal_column(f"'{_SQLITE_BUCKET_FORMATS[bucket]}'"), column)
    raise InvalidReport(f"reports support PostgreSQL and SQLite, not {dialect}")


def _price(prices: Mapping[str, float], tier: str) -> float:
    try:
        return prices[tier]
    except KeyError:
        raise MissingPrice(f"no price for tier {tier!r}; prices are set for {', '.join(sorted(prices))}") from None


def _utc(moment: datetime | date) -> datetime:
    """Naive UTC, the ledger's time type; a date means its midnight UTC."""
    if not isinstance(moment, datetime):
        return datetime.combine(moment, time())
    if moment.tzinfo is not None:
        return moment.astimezone(UTC).replace(tzinfo=None)
    return moment


def _as_datetime(value: datetime | str) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)
