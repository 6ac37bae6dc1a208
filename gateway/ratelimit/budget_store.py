"""Where budget reservations live: the protocol both stores keep, and the in-process store.

One state per budget period (``BudgetKey``): what the ledger says was spent, what admitted
requests hold (their worst case, by request id), and when it was loaded. A state is loaded
once from the ledger (gateway/budget_gate.py reads it) and then kept exact by reservations
and settlements; it is never reset. Settle-once is by request id:

- a request that finds its hold settles its actual cost into the period it finished in;
- a request whose hold is gone (Redis restarted and the state was rebuilt from the ledger while
  it ran) is counted only if it was admitted before that rebuild, finished after the rebuild's
  cutoff (rows finished before the cutoff were summed by it) and was not counted already;
  every such count is marked by request id, so it happens once;
- the orphan sweep settles only holds it still finds, so it never races a request's owner
  into a second count.

Rows that finished at or after the cutoff were read one by one by the rebuild and are marked
counted; the cutoff is a margin before the rebuild's read, so a row committed late (up to that
margin after its finish) is not lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

# Reservations compare sums of floats (USD): a budget spent to the last cent must not refuse for 1e-12.
EPSILON = 1e-9


@dataclass(frozen=True)
class BudgetKey:
    tenant: str
    unit: str
    period: str  # the budget's period spec: a change of spec starts a fresh state
    start: datetime  # the period's start, naive UTC
    end: datetime


@dataclass(frozen=True)
class Reservation:
    allowed: bool
    spent: float  # settled spend in the period, after this call
    held: float  # worst cases of requests in flight, this one included when allowed


@dataclass(frozen=True)
class Ask:
    """One budget's part of a reservation."""

    key: BudgetKey
    amount: float
    limit: float


@dataclass(frozen=True)
class Reservations:
    """A request's reservation in all its budgets at once: held in every one, or in none.

    ``missing``: indexes of states not loaded yet (nothing was checked); else one Reservation per
    ask, all allowed, or at least one refused (and nothing held anywhere).
    """

    missing: list[int]
    decisions: list[Reservation]

    @property
    def allowed(self) -> bool:
        return not self.missing and all(d.allowed for d in self.decisions)


@dataclass(frozen=True)
class Hold:
    request_id: str
    amount: float
    admitted_at: float  # time.time()


@dataclass(frozen=True)
class Settlement:
    """One request's end, for one budget."""

    request_id: str
    actual: float
    queued_at: float  # time.time() of the request's arrival
    finished_at: float  # time.time() of its end, as its ledger row has it
    hold_key: BudgetKey | None  # where it reserved (None: it reserved nothing for this budget)
    final_key: BudgetKey  # the period it finished in
    require_hold: bool = False  # the orphan sweep: settle only if the hold is still there


class BudgetStore(Protocol):
    async def reserve_all(self, asks: list[Ask], request_id: str, now: float) -> Reservations:
        """Hold each ask's amount if, in every one, spent + held + amount <= limit (one atomic step)."""
        ...

    async def reserve(self, key: BudgetKey, request_id: str, amount: float, limit: float,
                      now: float) -> Reservation | None:
        """reserve_all of one ask; None if its state is not loaded."""
        out = await self.reserve_all([Ask(key, amount, limit)], request_id, now)
        return None if out.missing else out.decisions[0]

    async def load(self, key: BudgetKey, spent: float, counted: list[str], loaded_at: float,
                   cutoff: float) -> None:
        """Set a state from the ledger, unless another replica loaded it first."""
        ...

    async def settle_all(self, settlements: list[Settlement]) -> list[float | None]:
        """Apply one request's end to each of its budgets (see the module docstring); each final period's
        spend, None where it is not loaded (or, for the sweep, where the hold was gone)."""
        ...

    async def release(self, key: BudgetKey, request_id: str) -> None:
        """Drop a hold whose request used nothing (it never reached the engine)."""
        ...

    async def state(self, key: BudgetKey) -> tuple[float, float] | None:
        """(spent, held), None if not loaded."""
        ...

    async def holds(self, key: BudgetKey) -> list[Hold]: ...

    async def first_soft_crossing(self, key: BudgetKey) -> bool:
        """True once per period state: whoever crosses the soft threshold first warns."""
        ...

    async def close(self) -> None: ...


@dataclass
class _State:
    spent: float
    loaded_at: float
    cutoff: float
    held: float = 0.0
    holds: dict[str, Hold] = field(default_factory=dict)
    counted: set[str] = field(default_factory=set)
    warned: bool = False


class InProcessBudgetStore(BudgetStore):
    """The states of one process (no Redis): lost with it, and rebuilt from the ledger at the next start."""

    def __init__(self) -> None:
        self._states: dict[BudgetKey, _State] = {}

    async def reserve_all(self, asks: list[Ask], request_id: str, now: float) -> Reservations:
        states = [self._states.get(a.key) for a in asks]
        missing = [i for i, s in enumerate(states) if s is None]
        if missing:
            return Reservations(missing, [])
        fits = [s.spent + s.held + a.amount <= a.limit * (1 + EPSILON) for s, a in zip(states, asks)]
        if not all(fits):
            return Reservations([], [Reservation(ok, s.spent, s.held) for ok, s in zip(fits, states)])
        for s, a in zip(states, asks):
            s.holds[request_id] = Hold(request_id, a.amount, now)
            s.held += a.amount
        return Reservations([], [Reservation(True, s.spent, s.held) for s in states])

    async def load(self, key: BudgetKey, spent: float, counted: list[str], loaded_at: float,
                   cutoff: float) -> None:
        self._states.setdefault(key, _State(spent, loaded_at, cutoff, counted=set(counted)))
        # Periods that ended long ago are dropped, as Redis expires them.
        for old in [k for k in self._states if k.tenant == key.tenant and k.unit == key.unit and k.end < key.start]:
            if not self._states[old].holds:
                del self._states[old]

    async def settle_all(self, settlements: list[Settlement]) -> list[float | None]:
        return [await self.settle(st) for st in settlements]

    async def settle(self, settlement: Settlement) -> float | None:
        st = settlement
        hold = None
        if st.hold_key is not None and (h := self._states.get(st.hold_key)) is not None:
            hold = h.holds.pop(st.request_id, None)
            if hold is not None:
                h.held -= hold.amount
        if hold is None and st.require_hold:
            return None
        f = self._states.get(st.final_key)
        if f is None:
            return None
        if hold is not None and st.hold_key == st.final_key:
            f.spent += st.actual
        elif st.request_id not in f.counted and (hold is not None or st.queued_at < f.loaded_at) \
                and st.finished_at >= f.cutoff:
            f.spent += st.actual
            f.counted.add(st.request_id)
        return f.spent

    async def release(self, key: BudgetKey, request_id: str) -> None:
        s = self._states.get(key)
        if s is not None and (hold := s.holds.pop(request_id, None)) is not None:
            s.held -= hold.amount

    async def state(self, key: BudgetKey) -> tuple[float, float] | None:
        s = self._states.get(key)
        return None if s is None else (s.spent, s.held)

    async def holds(self, key: BudgetKey) -> list[Hold]:
        s = self._states.get(key)
        return [] if s is None else list(s.holds.values())

    async def first_soft_crossing(self, key: BudgetKey) -> bool:
        s = self._states.get(key)
        if s is None or s.warned:
            return False
        s.warned = True
        return True

    async def close(self) -> None:
        self._states.clear()
