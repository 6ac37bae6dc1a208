"""UsageRecord: one request's usage as plain data, the unit the meter produces and the ledger and spool store."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from billing.models import LEDGER_STATUSES


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant: str | None
    tier: str
    adapter: str | None
    status: str  # open (admitted, still running) | ok | cancelled | error | rejected | interrupted
    queued_at: float  # time.time() seconds, like the engine's events
    finished_at: float
    first_token_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0  # the request's own compute
    # Recompute performed for this request after preemptions, by the tier that pays for it.
    recompute_by_tier: dict[str, float] = field(default_factory=dict)
    queue_seconds: float = 0.0  # waiting in the engine's queue
    owner: str | None = None  # an open row's process (billing.open_rows.PROCESS_OWNER)
    batch_id: str | None = None  # a Batch API line's batch, and the line's custom_id
    custom_id: str | None = None

    def __post_init__(self) -> None:
        # A bad row is refused here, before it could be spooled and retried forever.
        if self.status not in LEDGER_STATUSES:
            raise ValueError(f"status must be one of {', '.join(LEDGER_STATUSES)}, got {self.status!r}")
        if not self.request_id:
            raise ValueError("a usage record needs a request id")

    @property
    def recompute_gpu_seconds(self) -> float:
        return sum(self.recompute_by_tier.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageRecord:
        return cls(**data)

    def ledger_values(self) -> dict[str, Any]:
        """Column values of the record's usage_ledger row."""
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "tier": self.tier,
            "adapter": self.adapter,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "gpu_seconds": self.gpu_seconds,
            "recompute_gpu_seconds": self.recompute_gpu_seconds,
            "status": self.status,
            "queued_at": utc_datetime(self.queued_at),
            "first_token_at": None if self.first_token_at is None else utc_datetime(self.first_token_at),
            "finished_at": utc_datetime(self.finished_at),
            "queue_seconds": self.queue_seconds,
            "owner": self.owner,
            "batch_id": self.batch_id,
            "custom_id": self.custom_id,
        }


def utc_datetime(epoch_s: float) -> datetime:
    """Naive UTC datetime, the ledger's time type."""
    return datetime.fromtimestamp(epoch_s, UTC).replace(tzinfo=None)
