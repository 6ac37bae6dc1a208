"""Budgets: a tenant's spend limit in tokens, GPU-seconds or USD per period, set by the CLI and the admin API.

One budget per tenant and unit (a tenant may hold one of each). ``soft`` is the fraction of
the limit past which the gateway warns (a log line, a metric, a webhook); the limit itself is
hard: past it, requests are refused until the period ends. What was spent comes from the
ledger (billing.spend); enforcement across replicas is the gateway's (gateway/budget_gate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.errors import InvalidBudget, UnknownBudget
from billing.models import Budget, Tenant, utcnow
from billing.periods import Period, check_period, day_starts, period_at, zone
from billing.prices import PriceBook
from billing.spend import UNITS, spend_by_interval
from billing.tenants import find_tenant

DEFAULT_SOFT = 0.8
DEFAULT_TIMEZONE = "UTC"
MAX_BUDGET = 1e15


@dataclass(frozen=True)
class BudgetSettings:
    tenant: str
    unit: str  # tokens | gpu_seconds | usd
    limit: float
    period: str  # month | <N>d
    timezone: str
    soft: float
    anchored_at: datetime  # naive UTC
    updated_at: datetime

    def period_at(self, moment: datetime) -> Period:
        """The period holding ``moment`` (naive UTC)."""
        return period_at(self.period, self.timezone, self.anchored_at, moment)


def set_budget(engine: Engine, tenant: str, unit: str, limit: float, period: str = "month",
               soft: float = DEFAULT_SOFT, timezone: str = DEFAULT_TIMEZONE) -> BudgetSettings:
    """Create or replace the tenant's budget in ``unit``; an N-day period keeps its anchor unless it changes."""
    if unit not in UNITS:
        raise InvalidBudget(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not math.isfinite(limit) \
            or not 0 < limit <= MAX_BUDGET:
        raise InvalidBudget(f"the {unit} limit must be a positive number up to {MAX_BUDGET:g}, got {limit!r}")
    if unit == "tokens" and limit != int(limit):
        raise InvalidBudget(f"a tokens limit must be a whole number, got {limit!r}")
    if isinstance(soft, bool) or not isinstance(soft, int | float) or not 0 < soft <= 1:
        raise InvalidBudget(f"soft must be a fraction of the limit in (0, 1], got {soft!r}")
    check_period(period)
    if not isinstance(timezone, str):
        raise InvalidBudget(f"timezone must be a string, got {timezone!r}")
    zone(timezone)
    now = utcnow()
    with Session(engine) as session:
        owner = find_tenant(session, tenant)
        row = session.scalar(select(Budget).where(Budget.tenant_id == owner.id, Budget.unit == unit))
        if row is None:
            row = Budget(tenant_id=owner.id, unit=unit, anchored_at=now)
            session.add(row)
        elif (row.period, row.timezone) != (period, timezone):
            row.anchored_at = now
        row.limit, row.period, row.timezone, row.soft, row.updated_at = float(limit), period, timezone, float(soft), now
        session.commit()
        return _settings(row, owner.name)


def list_budgets(engine: Engine, tenant: str | None = None) -> list[BudgetSettings]:
    """Every budget (or one tenant's), by tenant then unit; an unknown tenant is UnknownTenant."""
    with Session(engine) as session:
        query = select(Budget, Tenant.name).join(Tenant, Budget.tenant_id == Tenant.id)
        if tenant is not None:
            query = query.where(Budget.tenant_id == find_tenant(session, tenant).id)
        rows = session.execute(query.order_by(Tenant.name, Budget.unit)).all()
        return [_settings(budget, name) for budget, name in rows]


def delete_budget(engine: Engine, tenant: str, unit: str) -> None:
    with Session(engine) as session:
        owner = find_tenant(session, tenant)
        row = session.scalar(select(Budget).where(Budget.tenant_id == owner.id, Budget.unit == unit))
        if row is None:
            raise UnknownBudget(f"tenant {tenant!r} has no {unit} budget")
        session.delete(row)
        session.commit()


def budgets_mark(engine: Engine) -> tuple[datetime | None, int]:
    """Changes whenever a budget is set or deleted: (latest change, number of budgets)."""
    with engine.connect() as connection:
        latest, count = connection.execute(select(func.max(Budget.updated_at), func.count(Budget.id))).one()
    return latest, int(count)


@dataclass(frozen=True)
class BudgetUsage:
    """What the ledger says a budget's current period has spent, in total and per local day."""

    budget: BudgetSettings
    period: Period
    spent: float
    days: list[tuple[date, float]]

    @property
    def left(self) -> float:
        return max(0.0, self.budget.limit - self.spent)


def budget_usage(engine: Engine, budget: BudgetSettings, prices: PriceBook, moment: datetime) -> BudgetUsage:
    """The spend of ``budget``'s period holding ``moment`` (naive UTC), by day of the budget's time zone."""
    period = budget.period_at(moment)
    days = day_starts(period, budget.timezone)
    with engine.connect() as connection:
        spend = spend_by_interval(connection, budget.tenant, [start for _, start in days] + [period.end], prices)
    per_day = [(day, s.amount(budget.unit)) for (day, _), s in zip(days, spend.intervals)]
    return BudgetUsage(budget, period, sum(amount for _, amount in per_day), per_day)


def _settings(b: Budget, tenant: str) -> BudgetSettings:
    return BudgetSettings(tenant, b.unit, b.limit, b.period, b.timezone, b.soft, b.anchored_at, b.updated_at)
