"""Prices per tier (per GPU-second, per million prompt and completion tokens), each with the date it takes effect.

A price row holds from its ``effective_from`` until the tier's next row, so a change never
reprices usage recorded before it: each ledger row is priced by its own ``finished_at``.
A tier with no price in effect costs nothing. ``PriceBook`` is the whole table in memory
(a handful of rows), what reports, budgets and /v1/usage price rows with.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.errors import InvalidPrice
from billing.models import Price, utcnow

PRICED_TIERS = ("premium", "standard", "batch")
# A price set "now" takes effect this much later, so that every replica (each polls the table every
# second or so) prices the first request under it by it, never by the price before.
LEAD_S = 5.0
MAX_PRICE = 1e9  # per unit; beyond this it is surely a typo


@dataclass(frozen=True)
class TierPrice:
    tier: str
    effective_from: datetime  # naive UTC
    per_gpu_second: float = 0.0
    per_million_prompt_tokens: float = 0.0
    per_million_completion_tokens: float = 0.0

    def cost(self, gpu_seconds: float, prompt_tokens: int, completion_tokens: int) -> float:
        """USD of this much usage at this price."""
        return (gpu_seconds * self.per_gpu_second + prompt_tokens * self.per_million_prompt_tokens / 1e6
                + completion_tokens * self.per_million_completion_tokens / 1e6)


FREE = TierPrice("", datetime.min)


class PriceBook:
    """Every tier's price history, to price usage by the moment it happened."""

    def __init__(self, prices: list[TierPrice]) -> None:
        self._by_tier: dict[str, list[TierPrice]] = {}
        for p in sorted(prices, key=lambda p: p.effective_from):
            self._by_tier.setdefault(p.tier, []).append(p)
        self._starts = {tier: [p.effective_from for p in rows] for tier, rows in self._by_tier.items()}

    def at(self, tier: str, when: datetime) -> TierPrice:
        """The tier's price in effect at ``when`` (naive UTC); FREE before its first price."""
        starts = self._starts.get(tier)
        if not starts:
            return FREE
        i = bisect.bisect_right(starts, when) - 1
        return self._by_tier[tier][i] if i >= 0 else FREE

    def changes_within(self, start: datetime, end: datetime) -> list[datetime]:
        """Moments in (start, end) where some tier's price changes: where usage must be split to be priced."""
        return sorted({s for starts in self._starts.values() for s in starts if start < s < end})

    def history(self) -> list[TierPrice]:
        """Every row, by tier then date: past, current and scheduled prices."""
        return [p for tier in sorted(self._by_tier) for p in self._by_tier[tier]]

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._by_tier.values())


def set_price(engine: Engine, tier: str, per_gpu_second: float, per_million_prompt_tokens: float,
              per_million_completion_tokens: float, effective_from: datetime | None = None,
              allow_past: bool = False) -> TierPrice:
    """Record a tier's new prices from ``effective_from`` (default: LEAD_S from now); a row set again for the
    same moment replaces it.

    A moment in the past is refused unless ``allow_past`` (imports of history): it would reprice usage
    already recorded.
    """
    if tier not in PRICED_TIERS:
        raise InvalidPrice(f"tier must be one of {', '.join(PRICED_TIERS)}, got {tier!r}")
    values = {"per_gpu_second": per_gpu_second, "per_million_prompt_tokens": per_million_prompt_tokens,
              "per_million_completion_tokens": per_million_completion_tokens}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not 0 <= value <= MAX_PRICE:
            raise InvalidPrice(f"{name} must be a number from 0 to {MAX_PRICE:g}, got {value!r}")
    now = utcnow()
    when = now + timedelta(seconds=LEAD_S) if effective_from is None else effective_from
    if when < now and not allow_past:
        raise InvalidPrice(f"a price cannot take effect in the past ({when.isoformat()}): that would reprice "
                           "usage already recorded")
    with Session(engine) as session:
        row = session.scalar(select(Price).where(Price.tier == tier, Price.effective_from == when))
        if row is None:
            row = Price(tier=tier, effective_from=when, **{k: float(v) for k, v in values.items()})
            session.add(row)
        else:
            for k, v in values.items():
                setattr(row, k, float(v))
            row.created_at = now
        session.commit()
        return _tier_price(row)


def load_price_book(engine: Engine) -> PriceBook:
    with Session(engine) as session:
        return PriceBook([_tier_price(p) for p in session.scalars(select(Price))])


def prices_mark(engine: Engine) -> tuple[datetime | None, int]:
    """Changes whenever a price is set: (latest write, number of rows)."""
    with engine.connect() as connection:
        latest, count = connection.execute(select(func.max(Price.created_at), func.count(Price.id))).one()
    return latest, int(count)


def _tier_price(p: Price) -> TierPrice:
    return TierPrice(p.tier, p.effective_from, p.per_gpu_second, p.per_million_prompt_tokens,
                     p.per_million_completion_tokens)
