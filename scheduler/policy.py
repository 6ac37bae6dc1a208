"""Who goes first and who gets preempted: the FCFS and tiered policies.

The scheduler owns the mechanics (budget, blocks, chunks); a policy only
answers ordering questions, so the two policies drop into the same engine.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable

from scheduler.block_manager import TierCap
from scheduler.config import SchedulerConfig
from scheduler.fairness import VirtualTokenCounters
from scheduler.sequence import Sequence

# Why a waiting sequence could not be admitted.
NO_SLOT = "slots"  # max_num_seqs running already
NO_ADAPTER = "adapter"  # max_loras distinct adapters running already
NO_BLOCKS = "blocks"


class Policy(ABC):
    """What the two policies answer; ``arrival`` maps seq_id to its arrival rank."""

    name = ""

    def __init__(self, config: SchedulerConfig, arrival: dict[str, int]) -> None:
        self.config = config
        self.arrival = arrival

    def latest(self, seqs: list[Sequence]) -> Sequence:
        return max(seqs, key=lambda s: self.arrival[s.seq_id])

    @abstractmethod
    def rank(self, seq: Sequence) -> tuple:
        """Sort key: the order running sequences are served in."""

    @abstractmethod
    def queue_of(self, seq: Sequence) -> str:
        """The waiting queue ``seq`` belongs to."""

    @abstractmethod
    def queue_names(self) -> list[str]:
        """Waiting queues, best first."""

    def caps(self) -> tuple[TierCap, ...]:
        return ()

    def is_spare(self, queue: str) -> bool:
        """Whether ``queue`` holds a spare-capacity tier (``TierConfig.spare_only``): its work is planned
        after every other queue's, and only while none of those has a request waiting."""
        return False

    def spare_headroom_blocks(self) -> int:
        """Blocks a spare-capacity admission must leave free: the other tiers' reserves and the margin."""
        return 0

    @abstractmethod
    def tiers_ahead(self, tier: str) -> set[str]:
        """The tiers whose queued prefill a new request of ``tier`` waits behind (its own included)."""

    @property
    def fair_within_tier(self) -> bool:
        """Whether tenants of one tier take turns (so each waits for its own backlog, not the tier's)."""
        return False

    def min_share_tokens(self) -> int:
        """Tokens of each step kept for the queues after the best one while they have work."""
        return 0

    def next_to_admit(self, queue: Iterable[Sequence], skipped: set[str]) -> Sequence | None:
        """The waiting sequence of ``queue`` to admit next, passing over ``skipped`` ids."""
        return next((s for s in queue if s.seq_id not in skipped), None)

    def goes_before(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether ``waiting`` is admitted before ``running`` (same queue) continues its prefill."""
        return False

    def express(self, queue: Iterable[Sequence], running: list[Sequence], budget: int,
                outlasts: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """Waiting sequences of ``queue`` to prefill whole in a step that carries no other prefill of the queue
        (``outlasts(seq)``: whether a running prefill's next chunk makes a long step; None: more than a step's
        token budget is left)."""
        return []

    # Fair-share bookkeeping; only the tiered policy with fair_share keeps any.
    def enqueued(self, seq: Sequence) -> None:
        pass

    def dequeued(self, seq: Sequence) -> None:
        pass

    def charge_prefill(self, seq: Sequence, start: int, num_tokens: int, sign: int = 1) -> None:
        pass

    def charge_decode(self, seq: Sequence) -> None:
        pass

    def counter_spread(self) -> dict[str, float]:
        """Per tier: max minus min virtual token counter over backlogged tenants."""
        return {}

    @abstractmethod
    def victim_for_running(self, needy: Sequence, running: list[Sequence]) -> Sequence:
        """The sequence to preempt so that running ``needy`` gets a block (may be ``needy``)."""

    def victim_for_waiting(
        self,
        waiting: Sequence,
        reason: str,
        running: list[Sequence],
        frees_enough: Callable[[list[Sequence]], bool],
    ) -> Sequence | None:
        """The sequence to preempt so that ``waiting`` can be admitted; None: it waits.

        ``frees_enough(seqs)`` tells whether preempting all of ``seqs`` would
        free the blocks ``waiting`` needs.
        """
        return None


class FcfsPolicy(Policy):
    """One queue in arrival order whatever the tier; the latest arrival is preempted (vLLM-like)."""

    name = "fcfs"

    def rank(self, seq: Sequence) -> tuple:
        return (self.arrival[seq.seq_id],)

    def queue_of(self, seq: Sequence) -> str:
        return "all"

    def queue_names(self) -> list[str]:
        return ["all"]

    def tiers_ahead(self, tier: str) -> set[str]:
        return {t.name for t in self.config.tiers}  # arrival order: everyone queued is ahead

    def victim_for_running(self, needy: Sequence, running: list[Sequence]) -> Sequence:
        return self.latest(running)


class TieredPolicy(Policy):
    """Better tiers first; KV reserves; worse tiers preempted first.

    Within a tier, with ``fair_share``, tenants take turns by virtual token
    counter (scheduler/fairness.py), FCFS inside each tenant; without it, FCFS.
    """

    name = "tiered"

    def __init__(self, config: SchedulerConfig, arrival: dict[str, int]) -> None:
        super().__init__(config, arrival)
        self.priority = {t.name: t.priority for t in config.tiers}
        self.spare = frozenset(t.name for t in config.tiers if t.spare_only)
        self.fair = (
            VirtualTokenCounters(config.fair_prefill_weight, config.fair_decode_weight) if config.fair_share else None
        )

    def rank(self, seq: Sequence) -> tuple:
        if self.fair is None:
            return (self.priority[seq.tier], self.arrival[seq.seq_id])
        return (self.priority[seq.tier], self.fair.counter(seq), self.arrival[seq.seq_id])

    def next_to_admit(self, queue: Iterable[Sequence], skipped: set[str]) -> Sequence | None:
        first = super().next_to_admit(queue, skipped)
        if self.fair is None or (first is not None and first.joins_group):
            return first  # a choice joining its admitted request is not a new turn of its tenant
        return self.fair.pick(queue, skipped)

    def goes_before(self, waiting: Sequence, running: Sequence) -> bool:
        return self.fair is not None and self.fair.counter(waiting) < self.fair.counter(running)

    def express(self, queue: Iterable[Sequence], running: list[Sequence], budget: int,
                outlasts: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """The first request of each tenant that has no other prefill work in its tier, if its prompt
        fits, when another tenant of the tier runs two more sequences than it or is prefilling a
        prompt whose next chunk ``outlasts`` a step (by default: more than a whole step's token budget left).

        A step lasts as long as its longest work, and every prefill that ends in it waits for
        all of it: beside a flood's prefill chunks, or one long prompt's step-sized chunk, a
        neighbour's short request would take as long as that step, not its own. Such a request
        (a light tenant's turn, not a backlog) gets a step with the running decodes and no other
        tenant's prefill of its tier. A flood's or a long prompt's own new request never
        qualifies (its tenant is prefilling already, or no one runs more than it), and the
        scheduler grants no two such steps in a row, so a backlogged tenant's prefill is held for
        at most every other step.
        """
        if self.fair is None:
            return []
        queue = [s for s in queue if s.tier not in self.spare]  # spare work never jumps in between layers
        # The choices of an admitted n > 1 request that wait to join it run as its tenant's sequences: they go
        # before everything queued, so beside them a neighbour's request waits as beside a flood.
        runs = Counter((s.tier, s.tenant) for s in [*running, *(s for s in queue if s.joins_group)])
        most = Counter()
        for (tier, _), n in runs.items():
            most[tier] = max(most[tier], n)
        busy = {(s.tier, s.tenant) for s in running if s.is_prefilling}
        if outlasts is None:
            outlasts = lambda s: s.num_tokens - s.num_computed_tokens > self.config.max_num_batched_tokens  # noqa: E731
        long_prefills = {(s.tier, s.tenant) for s in running if s.is_prefilling and outlasts(s)}
        waiting = Counter((s.tier, s.tenant) for s in queue)
        picked = []
        for seq in queue:
            key = (seq.tier, seq.tenant)
            if key in busy or waiting[key] > 1 or seq.num_tokens > budget:
                continue
            beside_long = any(tier == seq.tier and tenant != seq.tenant for tier, tenant in long_prefills)
            if runs[key] + 2 > most[seq.tier] and not beside_long:
                continue
            picked.append(seq)
            budget -= seq.num_tokens
        return picked

    def enqueued(self, seq: Sequence) -> None:
        if self.fair is not None:
            self.fair.enqueued(seq)

    def dequeued(self, seq: Sequence) -> None:
        if self.fair is not None:
            self.fair.dequeued(seq)

    def charge_prefill(self, seq: Sequence, start: int, num_tokens: int, sign: int = 1) -> None:
        if self.fair is not None:
            self.fair.charge_prefill(seq, start, num_tokens, sign)

    def charge_decode(self, seq: Sequence) -> None:
        if self.fair is not None:
            self.fair.charge_decode(seq)

    def counter_spread(self) -> dict[str, float]:
        if self.fair is None:
            return {}
        return {t.name: self.fair.spread(t.name) for t in self.config.tiers}

    def queue_of(self, seq: Sequence) -> str:
        return seq.tier

    def is_spare(self, queue: str) -> bool:
        return queue in self.spare

    def spare_headroom_blocks(self) -> int:
        reserved = sum(t.kv_reserve_fraction for t in self.config.tiers if not t.spare_only)
        return math.ceil((reserved + self.config.spare_kv_margin) * self.config.num_blocks)

    def tiers_ahead(self, tier: str) -> set[str]:
        return {name for name, rank in self.priority.items() if rank <= self.priority[tier]}

    @property
    def fair_within_tier(self) -> bool:
        return self.fair is not None

    def queue_names(self) -> list[str]:
        return [t.name for t in sorted(self.config.tiers, key=lambda t: t.priority)]

    def caps(self) -> tuple[TierCap, ...]:
        # A tier's reserve is kept from every strictly worse tier: those tiers
        # together may hold at most what the reserves of it and better ones leave.
        caps = []
        for tier in self.config.tiers:
            if tier.kv_reserve_fraction <= 0:
                continue
            reserved = sum(
                t.kv_reserve_fraction for t in self.config.tiers if t.priority <= tier.priority
            )
            worse = frozenset(t.name for t in self.config.tiers if t.priority > tier.priority)
            if worse:
                caps.append(TierCap(int(self.config.num_blocks * (1 - reserved)), worse))
        return tuple(caps)

    def min_share_tokens(self) -> int:
        return math.ceil(self.config.standard_min_share * self.config.max_num_batched_tokens)

    def _worse(self, seq: Sequence, running: list[Sequence]) -> list[Sequence]:
        return [s for s in running if self.priority[s.tier] > self.priority[seq.tier]]

    def _worst(self, seqs: list[Sequence]) -> list[Sequence]:
        """Those of ``seqs`` in the worst tier among them: a worse tier is preempted before a better one
        (batch before standard), so spare work always goes first."""
        bottom = max(self.priority[s.tier] for s in seqs)
        return [s for s in seqs if self.priority[s.tier] == bottom]

    def _most_blocks(self, seqs: list[Sequence]) -> Sequence:
        return max(seqs, key=lambda s: (len(s.block_table), self.arrival[s.seq_id]))

    def victim_for_running(self, needy: Sequence, running: list[Sequence]) -> Sequence:
        worse = self._worse(needy, running)
        if worse:
            return self._most_blocks(self._worst(worse))
        # Never a better tier: among equals the latest arrival of the most served tenant goes first.
        equals = [s for s in running if self.priority[s.tier] == self.priority[needy.tier]]
        if self.fair is not None:
            top = max(self.fair.counter(s) for s in equals)
            equals = [s for s in equals if self.fair.counter(s) == top]
        return self.latest(equals)

    def victim_for_waiting(
        self,
        waiting: Sequence,
        reason: str,
        running: list[Sequence],
        frees_enough: Callable[[list[Sequence]], bool],
    ) -> Sequence | None:
        worse = self._worse(waiting, running)
        if not worse:
            return self._fair_victim(waiting, reason, running, frees_enough) if self.fair is not None else None
        if reason == NO_SLOT:
            return self.latest(self._worst(worse))
        if reason == NO_BLOCKS:
            # Preempting is pointless if all of the worse tiers' blocks would not do.
            return self._most_blocks(self._worst(worse)) if frees_enough(worse) else None
        # NO_ADAPTER: free a slot held only by worse tiers, losing the fewest
        # sequences (ties: the group with the latest arrival).
        kept = {s.adapter for s in running if s not in worse}
        groups: dict[str, list[Sequence]] = {}
        for s in worse:
            if s.adapter is not None and s.adapter not in kept:
                groups.setdefault(s.adapter, []).append(s)
        if not groups:
            return None
        # A slot held by the worst tier alone goes first; then the one losing the fewest sequences.
        group = min(groups.values(), key=lambda g: (-min(self.priority[s.tier] for s in g), len(g),
                                                    -self.arrival[self.latest(g).seq_id]))
        return self.latest(group)

    def _fair_victim(
        self,
        waiting: Sequence,
        reason: str,
        running: list[Sequence],
        frees_enough: Callable[[list[Sequence]], bool],
    ) -> Sequence | None:
        """A same-tier sequence that gives way to ``waiting``, or None.

        Its tenant must be served no less than ``waiting``'s and run at least two more sequences
        of the tier: after the swap it still runs at least as many, so it cannot take the place
        back while nothing else changes. Once its tenant's other sequences end it could, so the
        sequence ``waiting`` gave way to (``Sequence.gave_way_to``, recorded by the scheduler when it
        preempts) is never its victim (no pair swaps back and forth). That
        is a newcomer's case: lifted level with a flood whose work in flight is not charged yet,
        it would otherwise wait for one of the flood's sequences to end. Never another tier's
        sequence, and never to make room for an adapter.
        """
        assert self.fair is not None
        if reason == NO_ADAPTER:
            return None
        fair = self.fair
        mine = fair.counter(waiting)
        runs = Counter(s.tenant for s in running if s.tier == waiting.tier)
        ahead = [
            s
            for s in running
            if s.tier == waiting.tier and fair.counter(s) >= mine and runs[s.tenant] >= runs[waiting.tenant] + 2
            and s.seq_id != waiting.gave_way_to
        ]
        if not ahead or (reason == NO_BLOCKS and not frees_enough(ahead)):
            return None
        top = max(self.fair.counter(s) for s in ahead)
        return self.latest([s for s in ahead if self.fair.counter(s) == top])


def make_policy(config: SchedulerConfig, arrival: dict[str, int]) -> Policy:
    if config.policy == "fcfs":
        return FcfsPolicy(config, arrival)
    if config.policy == "tiered":
        return TieredPolicy(config, arrival)
    raise ValueError(f"unknown scheduler policy {config.policy!r}: use 'tiered' or 'fcfs'")
