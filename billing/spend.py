"""A tenant's spend from the ledger over time intervals, in each budget unit: tokens, GPU-seconds and USD.

The ledger is the truth of what a tenant spent: budgets are rebuilt from it and /v1/usage
reads it. Counted: every closed row (ok, cancelled, error, interrupted) by its
``finished_at``; not counted: `open` rows (still running, counted when they close) and
`rejected` ones (no usage). GPU-seconds are the request's own compute (recompute after a
preemption is charged to the preempting tier, not to a tenant). USD prices each row by the
price in effect at its ``finished_at`` (billing.prices), so intervals are split at price
changes and each piece priced once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, and_, case, func, literal, select

from billing.models import UsageEntry
from billing.prices import PriceBook

UNITS = ("tokens", "gpu_seconds", "usd")
# Statuses whose rows hold usage that is final.
_NOT_COUNTED = ("open", "rejected")


@dataclass
class Spend:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    usd: float = 0.0

    def amount(self, unit: str) -> float:
        if unit == "tokens":
            return self.prompt_tokens + self.completion_tokens
        return self.gpu_seconds if unit == "gpu_seconds" else self.usd

    def add(self, prompt: int, completion: int, gpu: float, usd: float) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.gpu_seconds += gpu
        self.usd += usd


@dataclass
class IntervalSpend:
    """Spend per interval; with ``itemize_after``, the ids of the rows that finished at or after it."""

    intervals: list[Spend]
    itemized: list[str] = field(default_factory=list)


def interval_case(column, boundaries: list[datetime]):
    """SQL: the index i of the interval [b_i, b_i+1) holding ``column`` (rows are already within the range)."""
    inner = boundaries[1:-1]
    if not inner:
        return literal(0)
    return case(*((column < b, i) for i, b in enumerate(inner)), else_=len(inner))


def spend_by_interval(connection: Connection, tenant: str, boundaries: list[datetime], prices: PriceBook,
                      itemize_after: datetime | None = None) -> IntervalSpend:
    """The tenant's spend in each [boundaries[i], boundaries[i+1]), read in one statement (one snapshot)."""
    if len(boundaries) < 2 or any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError("boundaries must be at least two increasing moments")
    # Split where a price changes, so every piece has one price per tier.
    pieces = sorted(set(boundaries) | set(prices.changes_within(boundaries[0], boundaries[-1])))
    ledger = UsageEntry.__table__.c
    piece = interval_case(ledger.finished_at, pieces).label("piece")
    rid = (case((ledger.finished_at >= itemize_after, ledger.request_id), else_=None) if itemize_after is not None
           else literal(None)).label("rid")
    rows = connection.execute(
        select(piece, ledger.tier, rid, func.sum(ledger.prompt_tokens), func.sum(ledger.completion_tokens),
               func.sum(ledger.gpu_seconds))
        .where(and_(ledger.tenant == tenant, ledger.status.not_in(_NOT_COUNTED),
                    ledger.finished_at >= boundaries[0], ledger.finished_at < boundaries[-1]))
        .group_by(piece, ledger.tier, rid)
    )
    out = IntervalSpend([Spend() for _ in boundaries[:-1]])
    for index, tier, request_id, prompt, completion, gpu in rows:
        start = pieces[index]
        interval = bisect.bisect_right(boundaries, start) - 1
        usd = prices.at(tier, start).cost(gpu or 0.0, prompt or 0, completion or 0)
        out.intervals[interval].add(int(prompt or 0), int(completion or 0), float(gpu or 0.0), usd)
        if request_id is not None:
            out.itemized.append(request_id)
    return out


def row_amount(unit: str, tier: str, finished_at: datetime, prompt_tokens: int, completion_tokens: int,
               gpu_seconds: float, prices: PriceBook) -> float:
    """One request's spend in ``unit``, priced as spend_by_interval prices it."""
    if unit == "tokens":
        return prompt_tokens + completion_tokens
    if unit == "gpu_seconds":
        return gpu_seconds
    return prices.at(tier, finished_at).cost(gpu_seconds, prompt_tokens, completion_tokens)
