"""UsageMeter: turns the engine's step and finish events into one UsageRecord per request.

A step's duration is split across its requests by the event's own rule (token share); recompute
after a preemption is kept apart and charged to the tier that preempted. The engine calls the
meter on its own thread, so handlers only do arithmetic under a lock: no I/O. Billing imports
nothing of the engine: the events are read through the protocols below.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from billing.models import LEDGER_STATUSES
from billing.usage_record import UsageRecord


class StepShare(Protocol):
    """One request's part of a step (engine.events.StepItem)."""

    request_id: str
    is_recompute: bool
    charged_tier: str


class Step(Protocol):
    """A step the engine ran (engine.events.StepEvent)."""

    duration_s: float

    def seconds_by_item(self) -> list[tuple[StepShare, float]]: ...


class Finish(Protocol):
    """A request's end (engine.events.FinishEvent)."""

    request_id: str
    status: str
    tier: str
    adapter: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queued_at: float
    first_token_at: float | None
    finished_at: float
    queue_s: float


@dataclass
class _Open:
    """What is known of a request between admission and its finish event."""

    tenant: str | None = None
    tier: str | None = None
    adapter: str | None = None
    queued_at: float | None = None
    gpu_seconds: float = 0.0
    recompute: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by paying tier


class UsageMeter:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open: dict[str, _Open] = {}
        self._finished: dict[str, UsageRecord] = {}
        self.busy_seconds = 0.0  # total duration of the steps seen: what conservation checks against
        self.charged_seconds = 0.0  # total charged outside steps (charge()): conservation adds it

    def begin(self, request_id: str, tenant: str, tier: str, adapter: str | None = None,
              queued_at: float | None = None) -> None:
        """Register an admitted request's tenant context before it reaches the engine."""
        with self._cond:
            entry = self._open.setdefault(request_id, _Open())
            entry.tenant, entry.tier, entry.adapter = tenant, tier, adapter
            entry.queued_at = time.time() if queued_at is None else queued_at

    def charge(self, request_id: str, seconds: float) -> None:
        """Bill a request for compute spent on it outside the engine's steps (compiling its grammar), as
        GPU-seconds of its own; a request refused after it is still billed for it (record_rejected)."""
        with self._cond:
            self._open.setdefault(request_id, _Open()).gpu_seconds += seconds
            self.charged_seconds += seconds

    def on_step(self, event: Step) -> None:
        shares = event.seconds_by_item()
        if not shares:
            return
        with self._cond:
            self.busy_seconds += event.duration_s
            for item, seconds in shares:
                entry = self._open.setdefault(item.request_id, _Open())
                if item.is_recompute:
                    entry.recompute[item.charged_tier] += seconds
                else:
                    entry.gpu_seconds += seconds

    def on_finish(self, event: Finish) -> None:
        with self._cond:
            entry = self._open.pop(event.request_id, None) or _Open()
            tier = entry.tier or event.tier
            status = event.status if event.status in LEDGER_STATUSES else "error"
            self._finished[event.request_id] = UsageRecord(
                request_id=event.request_id,
                tenant=entry.tenant,
                tier=tier,
                adapter=entry.adapter if entry.tier is not None else event.adapter,
                status=status,
                queued_at=entry.queued_at or event.queued_at or event.finished_at,
                finished_at=event.finished_at or time.time(),
                first_token_at=event.first_token_at,
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                completion_tokens=event.completion_tokens,
                gpu_seconds=entry.gpu_seconds,
                recompute_by_tier=dict(entry.recompute),
                queue_seconds=event.queue_s,
            )
            self._cond.notify_all()

    def take_record(self, request_id: str) -> UsageRecord | None:
        """A begun request's record if its finish event has arrived (and forgets it), else None; never blocks.

        For a listener placed after the meter on the engine thread. Records of requests never
        begun (engine-internal ones) stay for pop_unclaimed().
        """
        with self._cond:
            record = self._finished.get(request_id)
            if record is None or record.tenant is None:
                return None
            return self._finished.pop(request_id)

    def record_rejected(self, request_id: str, tenant: str, tier: str, adapter: str | None = None,
                        queued_at: float | None = None) -> UsageRecord:
        """A rejected request: counted in the ledger, costs nothing but what was charged for it (charge())."""
        now = time.time()
        with self._cond:
            entry = self._open.pop(request_id, None)
        return UsageRecord(
            request_id=request_id,
            tenant=tenant,
            tier=tier,
            adapter=adapter,
            status="rejected",
            queued_at=now if queued_at is None else queued_at,
            finished_at=now,
            gpu_seconds=entry.gpu_seconds if entry is not None else 0.0,
        )

    def forget(self, request_id: str) -> None:
        """Drop a begun request that never reached the engine (and so will never finish)."""
        with self._cond:
            self._open.pop(request_id, None)
            self._finished.pop(request_id, None)

    def gpu_seconds_so_far(self, request_ids: list[str]) -> dict[str, float]:
        """The GPU-seconds of running requests up to now (recompute excluded), for saving their progress."""
        with self._cond:
            return {rid: entry.gpu_seconds for rid in request_ids if (entry := self._open.get(rid)) is not None}

    def pop_unclaimed(self) -> list[UsageRecord]:
        """Finished records nobody will claim: requests never begun (driven on the engine directly) or
        forgotten (their caller gave up waiting); gateway.usage_recorder writes them periodically.

        Records of begun requests stay for their take_record() caller.
        """
        with self._cond:
            records = [r for r in self._finished.values() if r.tenant is None]
            for record in records:
                del self._finished[record.request_id]
            return records
