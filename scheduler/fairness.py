"""Fair share between the tenants of one tier: virtual token counters.

After "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024).
Each tenant has a counter per tier that grows with the service it is given,
divided by its weight: ``prefill_weight`` per prompt token computed (charged
chunk by chunk as the prefill is planned, so a long prompt costs as it runs)
and ``decode_weight`` per generated token. The scheduler admits from the
backlogged tenant (one with waiting sequences) whose counter is lowest, and
preempts from the one whose counter is highest.

A tenant that becomes backlogged (a new request, or one sent back by a
preemption) is lifted to the lowest counter among the
backlogged tenants (or, when none is, to the counter of the last one to leave
the backlog), so time spent idle is never banked as credit. Recompute after a
preemption is not charged: the tenant already paid for those tokens once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass
class _TierBooks:
    counters: dict[str | None, float] = field(default_factory=dict)
    backlog: Counter = field(default_factory=Counter)  # tenant -> its waiting sequences
    last_left: float = 0.0  # counter of the tenant whose leaving emptied the backlog


class VirtualTokenCounters:
    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 2.0) -> None:
        if not (prefill_weight > 0 and decode_weight > 0):
            raise ValueError("fair-share token weights must be positive")
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self._tiers: dict[str, _TierBooks] = {}

    def _books(self, tier: str) -> _TierBooks:
        return self._tiers.setdefault(tier, _TierBooks())

    def counter(self, seq: Sequence) -> float:
        return self._books(seq.tier).counters.get(seq.tenant, 0.0)

    def enqueued(self, seq: Sequence) -> None:
        """``seq`` joined its tier's waiting queue: new, or back after a preemption."""
        books = self._books(seq.tier)
        if books.backlog[seq.tenant] == 0:
            others = [books.counters.get(t, 0.0) for t, n in books.backlog.items() if n]
            floor = min(others) if others else books.last_left
            books.counters[seq.tenant] = max(books.counters.get(seq.tenant, 0.0), floor)
        books.backlog[seq.tenant] += 1

    def dequeued(self, seq: Sequence) -> None:
        """``seq`` left its tier's waiting queue (admitted, aborted)."""
        books = self._books(seq.tier)
        books.backlog[seq.tenant] -= 1
        if books.backlog[seq.tenant] <= 0:
            del books.backlog[seq.tenant]
            if not books.backlog:
                books.last_left = books.counters.get(seq.tenant, 0.0)

    def charge_prefill(self, seq: Sequence, start: int, num_tokens: int, sign: int = 1) -> None:
        """Positions ``[start, start + num_tokens)`` of ``seq`` were planned (sign -1: taken back)."""
        first = max(start, seq.recompute_until)
        prompt = max(0, min(start + num_tokens, seq.num_prompt_tokens) - first)
        if prompt:
            self._add(seq, sign * prompt * self.prefill_weight)

    def charge_decode(self, seq: Sequence, num_tokens: int = 1) -> None:
        self._add(seq, num_tokens * self.decode_weight)

    def _add(self, seq: Sequence, cost: float) -> None:
        books = self._books(seq.tier)
        books.counters[seq.tenant] = books.counters.get(seq.tenant, 0.0) + cost / seq.weight

    def spread(self, tier: str) -> float:
        """Max minus min counter over the tier's backlogged tenants (0 with fewer than two)."""
        books = self._books(tier)
        values = [books.counters.get(t, 0.0) for t, n in books.backlog.items() if n]
        return max(values) - min(values) if len(values) > 1 else 0.0

    def pick(self, queue: Iterable[Sequence], skipped: set[str]) -> Sequence | None:
        """The first not-skipped waiting sequence of the lowest-counter tenant in ``queue``.

        FCFS inside one tenant: the queue is in arrival order (preempted ones at the front).
        """
        best: Sequence | None = None
        best_counter = 0.0
        seen: set[str | None] = set()
        for seq in queue:
            if seq.seq_id in skipped or seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            counter = self.counter(seq)
            if best is None or counter < best_counter:
                best, best_counter = seq, counter
        return best
