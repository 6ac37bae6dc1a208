"""Per-tenant counts of work under way in this process, each bounded by a limit of the tenant's own.

Two of them, held by the app's wiring (gateway/services.py): the requests each tenant has between its key
and its admission (``Gateway.reading_slots``: bodies being read, parsed and tokenized, work that grows
with the body and runs on the event loop), and the grammars each tenant is compiling
(``Gateway.grammar_slots``, gateway/grammar_budget.py). A module of its own, free of the engine's
imports, because the wiring is imported by commands that never serve. Used on the event loop only.
"""

from __future__ import annotations


class TenantSlots:
    """How many of one kind of work each tenant has under way in this process."""

    def __init__(self) -> None:
        self._under_way: dict[str, int] = {}

    def has_room(self, tenant: str, limit: int) -> bool:
        """Whether ``take`` would count one more for ``tenant`` now."""
        return self._under_way.get(tenant, 0) < limit

    def take(self, tenant: str, limit: int) -> bool:
        """Count one more for ``tenant``, unless it already has ``limit``."""
        if not self.has_room(tenant, limit):
            return False
        self._under_way[tenant] = self._under_way.get(tenant, 0) + 1
        return True

    def give_back(self, tenant: str) -> None:
        left = self._under_way.get(tenant, 0) - 1
        if left > 0:
            self._under_way[tenant] = left
        else:
            self._under_way.pop(tenant, None)

    def under_way(self, tenant: str) -> int:
        return self._under_way.get(tenant, 0)


class HeldSlot:
    """One slot ``take``-n for a tenant, given back exactly once however many times ``give_back`` is called."""

    def __init__(self, slots: TenantSlots, tenant: str) -> None:
        self._slots, self._tenant, self._held = slots, tenant, True

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._slots.give_back(self._tenant)
