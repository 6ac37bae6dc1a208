"""Budget metrics, in the app's registry: the spent fraction of each budget, and soft-threshold crossings.

``tiergate_budget_spent_ratio{tenant,unit}`` is the one tiergate series with a tenant label, as
finance asks: one series per tenant with a budget in that unit (so bounded by the budgets set,
not by traffic), removed when the budget is. Crossings carry only the unit.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from billing.spend import UNITS


class BudgetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.spent_ratio = Gauge("tiergate_budget_spent_ratio",
                                 "Spent fraction of each budget in its current period (tenants with a budget only).",
                                 ["tenant", "unit"], registry=registry)
        self.soft_crossings = Counter("tiergate_budget_soft_threshold_crossings_total",
                                      "Budgets that crossed their soft threshold (once per budget and period).",
                                      ["unit"], registry=registry)
        for unit in UNITS:
            self.soft_crossings.labels(unit)

    def observe(self, tenant: str, unit: str, ratio: float) -> None:
        self.spent_ratio.labels(tenant, unit).set(ratio)

    def forget(self, tenant: str, unit: str) -> None:
        try:
            self.spent_ratio.remove(tenant, unit)
        except KeyError:  # never observed
            pass
