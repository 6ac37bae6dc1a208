"""How many grammars each tenant is compiling now, in this process (gateway/grammar_budget.py bounds it).

A module of its own, free of the engine's imports, because the app's wiring
(gateway/services.py) holds one and is imported by commands that never serve.
"""

from __future__ import annotations


class CompileSlots:
    """How many grammars each tenant has compiling in this process; used on the event loop only."""

    def __init__(self) -> None:
        self._compiling: dict[str, int] = {}

    def take(self, tenant: str, limit: int) -> bool:
        if self._compiling.get(tenant, 0) >= limit:
            return False
        self._compiling[tenant] = self._compiling.get(tenant, 0) + 1
        return True

    def give_back(self, tenant: str) -> None:
        left = self._compiling.get(tenant, 0) - 1
        if left > 0:
            self._compiling[tenant] = left
        else:
            self._compiling.pop(tenant, None)

    def compiling(self, tenant: str) -> int:
        return self._compiling.get(tenant, 0)
