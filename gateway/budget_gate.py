"""Budgets at admission: a request reserves its worst case against each of its tenant's budgets, and settles
its actual cost (its ledger row) when it ends. The rules that keep this exact are budget_store.py's.

Per request and budget: tokens reserve prompt + n * max_tokens; GPU-seconds reserve those tokens
times twice the GPU-seconds per token this replica's finished requests of the tier have cost
(a moving average; the engine's step time per token before any has finished); USD prices both
at the tier's current prices. A request past a hard limit is refused with 429
``insufficient_quota``, naming the budget and when it resets.

The budgets and prices in force are cached and reloaded whenever a cheap mark in the database
changes (polled every ``poll_s``), so a change made on any replica or by the CLI holds
everywhere within that time. A period's state is loaded from the ledger the first time a
request needs it (a new period, a restarted Redis or process): the ledger is the truth.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio.to_thread
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, select

from billing.budgets import BudgetSettings, budgets_mark, list_budgets
from billing.models import UsageEntry
from billing.prices import PriceBook, load_price_book, prices_mark
from billing.spend import row_amount, spend_by_interval
from billing.usage_record import UsageRecord, utc_datetime
from gateway.budget_alerts import WebhookNotifier
from gateway.budget_metrics import BudgetMetrics
from gateway.errors import APIError
from gateway.ratelimit.base import retry_headers
from gateway.ratelimit.budget_store import Ask, BudgetKey, BudgetStore, InProcessBudgetStore, Reservation, Settlement

log = logging.getLogger(__name__)

# Rows finished within this much before a state's load are read one by one (see budget_store.py):
# a row committed later than this after its request ended could be missed by a rebuild.
LOAD_MARGIN_S = 30.0
PRIOR_GPU_SECONDS_PER_TOKEN = 0.01  # until a request of the tier has finished on this replica
GPU_SAFETY = 2.0
EMA_ALPHA = 0.1
UNIT_NAMES = {"tokens": "tokens", "gpu_seconds": "GPU-seconds", "usd": "USD"}


@dataclass
class _Reserved:
    tenant: str
    tier: str
    queued_at: float
    keys: dict[str, BudgetKey] = field(default_factory=dict)  # by unit


def make_budget_store(redis_url: str | None, key_prefix: str) -> BudgetStore:
    if not redis_url:
        return InProcessBudgetStore()
    from gateway.ratelimit.budget_redis import RedisBudgetStore

    return RedisBudgetStore(redis_url, key_prefix=key_prefix)


def budget_key(budget: BudgetSettings, moment: datetime) -> BudgetKey:
    period = budget.period_at(moment)
    return BudgetKey(budget.tenant, budget.unit, f"{budget.period}@{budget.timezone}", period.start, period.end)


class BudgetGate:
    def __init__(self, db: Engine, store: BudgetStore, registry: CollectorRegistry | None = None,
                 webhook_url: str | None = None, clock=time.time) -> None:
        self.db = db
        self.store = store
        self.clock = clock
        self.notifier = WebhookNotifier(webhook_url)
        self.budgets: dict[str, list[BudgetSettings]] = {}
        self.prices = PriceBook([])
        self._mark: object = None
        self._reserved: dict[str, _Reserved] = {}
        self._gpu_per_token: dict[str, float] = {}
        self.metrics = BudgetMetrics(registry if registry is not None else CollectorRegistry())

    # -- configuration ----------------------------------------------------

    def refresh(self) -> bool:
        """Reload budgets and prices if their mark changed (a database read; off the event loop)."""
        mark = (budgets_mark(self.db), prices_mark(self.db))
        if mark == self._mark:
            return False
        budgets: dict[str, list[BudgetSettings]] = {}
        for b in list_budgets(self.db):
            budgets.setdefault(b.tenant, []).append(b)
        self.prices = load_price_book(self.db)
        gone = {(t, b.unit) for t, bs in self.budgets.items() for b in bs} - \
            {(t, b.unit) for t, bs in budgets.items() for b in bs}
        for labels in gone:
            self.metrics.forget(*labels)
        self.budgets, self._mark = budgets, mark
        return True

    # -- admission --------------------------------------------------------

    async def admit(self, request_id: str, tenant: str, tier: str, queued_at: float, prompt_tokens: int,
                    max_completion_tokens: int) -> None:
        """Reserve the request's worst case in each budget of its tenant, or raise 429 and reserve nothing."""
        if self._mark is None:
            await anyio.to_thread.run_sync(self.refresh)
        budgets = self.budgets.get(tenant)
        if not budgets:
            return
        now = self.clock()
        moment = utc_datetime(now)
        asks = [Ask(budget_key(b, moment), self._worst_case(b.unit, tier, moment, prompt_tokens,
                                                            max_completion_tokens), b.limit) for b in budgets]
        out = await self.store.reserve_all(asks, request_id, now)
        if out.missing:  # a new period, or a state Redis lost: from the ledger, then once more
            for i in out.missing:
                await self._load(asks[i].key, now)
            out = await self.store.reserve_all(asks, request_id, now)
        if not out.allowed:
            i = next((i for i, d in enumerate(out.decisions) if not d.allowed), 0)
            d = out.decisions[i] if out.decisions else Reservation(False, 0.0, 0.0)
            raise budget_exceeded(budgets[i], asks[i].key, d.spent, d.held, asks[i].amount)
        self._reserved[request_id] = _Reserved(tenant, tier, queued_at,
                                               {b.unit: a.key for b, a in zip(budgets, asks)})

    async def release(self, request_id: str) -> None:
        """Give back what a request reserved when it used nothing (it never reached the engine)."""
        reserved = self._reserved.pop(request_id, None)
        for key in reserved.keys.values() if reserved else ():
            await self.store.release(key, request_id)

    def _worst_case(self, unit: str, tier: str, moment: datetime, prompt: int, completion: int) -> float:
        if unit == "tokens":
            return prompt + completion
        gpu = (prompt + completion) * GPU_SAFETY * self._gpu_per_token.get(tier, PRIOR_GPU_SECONDS_PER_TOKEN)
        return gpu if unit == "gpu_seconds" else self.prices.at(tier, moment).cost(gpu, prompt, completion)

    async def _load(self, key: BudgetKey, now: float) -> None:
        """Load a period's state from the ledger (unless another replica just did)."""
        cutoff = now - LOAD_MARGIN_S
        spend = await anyio.to_thread.run_sync(self._read_period, key, cutoff)
        await self.store.load(key, spend.intervals[0].amount(key.unit), spend.itemized, now, cutoff)

    def _read_period(self, key: BudgetKey, cutoff: float):
        with self.db.connect() as connection:
            return spend_by_interval(connection, key.tenant, [key.start, key.end], self.prices,
                                     itemize_after=utc_datetime(cutoff))

    # -- settlement -------------------------------------------------------

    async def settle(self, record: UsageRecord, require_hold: bool = False) -> None:
        """Count a finished request's row in every budget of its tenant (idempotent per request id)."""
        reserved = self._reserved.pop(record.request_id, None)
        if record.status in ("open", "rejected"):
            return
        self._observe_gpu(record)  # every tenant's requests teach the estimate, budgets or not
        budgets = self.budgets.get(record.tenant or "", [])
        if not budgets:
            return
        finished = utc_datetime(record.finished_at)
        settlements = []
        for budget in budgets:
            hold = reserved.keys.get(budget.unit) if reserved else None
            if require_hold:
                hold = budget_key(budget, utc_datetime(record.queued_at))
            actual = row_amount(budget.unit, record.tier, finished, record.prompt_tokens, record.completion_tokens,
                                record.gpu_seconds, self.prices)
            settlements.append(Settlement(record.request_id, actual, record.queued_at, record.finished_at, hold,
                                          budget_key(budget, finished), require_hold))
        now = utc_datetime(self.clock())
        for budget, st, spent in zip(budgets, settlements, await self.store.settle_all(settlements)):
            if spent is not None and st.final_key.start <= now < st.final_key.end:
                await self._observe_spent(budget, st.final_key, spent)

    def _observe_gpu(self, record: UsageRecord) -> None:
        tokens = record.prompt_tokens + record.completion_tokens
        if tokens and record.gpu_seconds > 0:
            per_token = record.gpu_seconds / tokens
            old = self._gpu_per_token.get(record.tier)
            self._gpu_per_token[record.tier] = per_token if old is None else old + EMA_ALPHA * (per_token - old)

    async def _observe_spent(self, budget: BudgetSettings, key: BudgetKey, spent: float) -> None:
        self.metrics.observe(budget.tenant, budget.unit, spent / budget.limit)
        if spent >= budget.soft * budget.limit and await self.store.first_soft_crossing(key):
            self.metrics.soft_crossings.labels(budget.unit).inc()
            log.warning("budget: tenant %s has spent %s of its %s %s budget (soft threshold %.0f%%) in the period "
                        "from %s", budget.tenant, _fmt(spent), _fmt(budget.limit), UNIT_NAMES[budget.unit],
                        100 * budget.soft, key.start.isoformat())
            self.notifier.notify({
                "event": "budget.soft_threshold", "tenant": budget.tenant, "unit": budget.unit,
                "limit": budget.limit, "spent": spent, "soft": budget.soft,
                "period_start": key.start.isoformat() + "Z", "period_end": key.end.isoformat() + "Z",
            })

    # -- background ----------------------------------------------------------

    async def sweep(self, orphan_after_s: float) -> int:
        """Settle the holds of requests whose process died: from their ledger rows once closed (by the
        restart's or another replica's orphan sweep), or as nothing when no row ever appeared; returns
        how many were settled."""
        now = self.clock()
        moment = utc_datetime(now)
        old = [(key, h) for budgets in list(self.budgets.values()) for b in budgets
               for key in [budget_key(b, moment)] for h in await self.store.holds(key)
               if h.admitted_at < now - orphan_after_s and h.request_id not in self._reserved]
        if not old:
            return 0
        rows = await anyio.to_thread.run_sync(self._rows, sorted({h.request_id for _, h in old}))
        settled = 0
        for key, hold in old:
            row = rows.get(hold.request_id)
            if row is not None and row.status not in ("open", "rejected"):
                await self.settle(row, require_hold=True)
                settled += 1
            elif row is None and hold.admitted_at < now - 2 * orphan_after_s:
                await self.store.release(key, hold.request_id)  # nothing ran: the ledger has no row for it
                settled += 1
        return settled

    def _rows(self, request_ids: list[str]) -> dict[str, UsageRecord]:
        ledger = UsageEntry.__table__.c
        with self.db.connect() as connection:
            found = connection.execute(select(ledger.request_id, ledger.tenant, ledger.tier, ledger.status,
                                              ledger.queued_at, ledger.finished_at, ledger.prompt_tokens,
                                              ledger.completion_tokens, ledger.gpu_seconds)
                                       .where(ledger.request_id.in_(request_ids))).all()
        return {r.request_id: UsageRecord(
            request_id=r.request_id, tenant=r.tenant, tier=r.tier, adapter=None, status=r.status,
            queued_at=_epoch(r.queued_at), finished_at=_epoch(r.finished_at), prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens, gpu_seconds=r.gpu_seconds) for r in found}

    async def run_background(self, poll_s: float, orphan_after_s: float) -> None:
        """Until cancelled: reload changed budgets and prices, refresh the gauges, settle orphaned holds."""
        from billing.db import UNAVAILABLE

        last_sweep = 0.0
        while True:
            try:
                await anyio.to_thread.run_sync(self.refresh)
                await self.refresh_gauges()
                if time.monotonic() - last_sweep >= orphan_after_s / 2:
                    last_sweep = time.monotonic()
                    await self.sweep(orphan_after_s)
            except UNAVAILABLE as exc:
                log.debug("budgets: not refreshed, database unavailable: %s", exc)
            except Exception:
                log.exception("budgets: background refresh failed")
            await anyio.sleep(poll_s)

    async def refresh_gauges(self) -> None:
        moment = utc_datetime(self.clock())
        for budgets in list(self.budgets.values()):
            for b in budgets:
                state = await self.store.state(budget_key(b, moment))
                if state is not None:
                    self.metrics.observe(b.tenant, b.unit, state[0] / b.limit)

    async def close(self) -> None:
        await self.store.close()


def budget_exceeded(budget: BudgetSettings, key: BudgetKey, spent: float, held: float, amount: float) -> APIError:
    unit = UNIT_NAMES[budget.unit]
    period = "calendar month" if budget.period == "month" else f"{budget.period[:-1]} days"
    message = (f"You exceeded your {unit} budget: {_fmt(budget.limit)} {unit} per {period} ({budget.timezone}), "
               f"{_fmt(spent)} spent and {_fmt(held)} held by requests in flight; this request needs up to "
               f"{_fmt(amount)}. The budget resets at {key.end.isoformat()}Z.")
    headers = {**retry_headers(float("inf")), "x-budget-reset": key.end.isoformat() + "Z"}
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota", headers=headers)


def _fmt(value: float) -> str:
    return f"{value:.6g}" if value != int(value) else str(int(value))


def _epoch(moment: datetime) -> float:
    return moment.replace(tzinfo=UTC).timestamp()

