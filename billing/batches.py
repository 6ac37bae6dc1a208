"""Batches as OpenAI shows them: creation (with the tenant's queue limit), reads, lists and cancel.

A batch is created ``validating``; billing/batch_intake.py takes it to ``in_progress`` or ``failed``.

A batch's lines live in batch_lines (billing.batch_lines runs them); its request_counts are
counted from their states when it is read. Every read takes the tenant: another tenant's batch
is unknown (None), never forbidden.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select, update

from billing.batch_models import Batch, BatchLine
from billing.errors import BillingError, UnknownTenant
from billing.models import Tenant

_BATCHES = Batch.__table__
_LINES = BatchLine.__table__
# The statuses whose lines still count against the tenant's queue limit.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")


class BatchQueueFull(BillingError):
    """The tenant's unfinished batches already hold as many tokens as its limit allows."""


@dataclass(frozen=True)
class LineSpec:
    """One validated input line."""

    line: int
    custom_id: str
    body: str  # the request's JSON body
    tokens: int  # prompt plus max_tokens (times choices): what it reserves of the queue limit


@dataclass(frozen=True)
class BatchInfo:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    total: int
    reserved_tokens: int
    times: dict[str, int | None]
    counts: dict[str, int] = field(default_factory=dict)  # lines by state

    def to_openai(self) -> dict[str, Any]:
        done = self.counts.get("succeeded", 0)
        failed = self.counts.get("failed", 0)
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            **self.times,
            "request_counts": {"total": self.total, "completed": done, "failed": failed},
            "metadata": self.metadata,
        }


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def create_batch(db: Engine, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
                 metadata: dict[str, str] | None, total: int, window_s: int) -> BatchInfo:
    """A batch ``validating``: a driver checks its lines next (billing/batch_intake.py). BatchQueueFull when the
    tenant's unfinished batches already hold its whole ``batch_queue_tokens``: no batch could fit beside them.

    ``total`` is the input file's line count, what the batch holds if every line passes."""
    now = int(time.time())
    batch_id = new_batch_id()
    with db.begin() as connection:
        limit, held = unfinished_tokens(connection, tenant)
        if held >= limit:
            raise BatchQueueFull(
                f"Enqueued token limit reached: your unfinished batches hold {held} tokens (prompts plus max_tokens) "
                f"of your limit of {limit}. Wait for them to finish before sending another.")
        connection.execute(insert(_BATCHES).values(
            id=batch_id, tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
            completion_window=completion_window, status="validating",
            metadata_json=None if metadata is None else json.dumps(metadata), total=total,
            reserved_tokens=0, created_at=now, expires_at=now + window_s))
    return get_batch(db, tenant, batch_id)


def unfinished_tokens(connection: Connection, tenant: str, exclude: str | None = None) -> tuple[int, int]:
    """(the tenant's batch_queue_tokens, the tokens its unfinished batches hold but ``exclude``).

    On PostgreSQL the tenant's row stays locked to the end of the caller's transaction (SQLite serializes
    writers), so two batches checked at once cannot both pass the limit."""
    limit_query = select(Tenant.batch_queue_tokens).where(Tenant.name == tenant)
    if connection.dialect.name == "postgresql":
        limit_query = limit_query.with_for_update()
    limit = connection.execute(limit_query).scalar()
    if limit is None:
        raise UnknownTenant(f"unknown tenant {tenant!r}")
    query = select(_BATCHES.c.reserved_tokens).where(_BATCHES.c.tenant == tenant, _BATCHES.c.status.in_(UNFINISHED))
    if exclude is not None:
        query = query.where(_BATCHES.c.id != exclude)
    return limit, sum(connection.execute(query).scalars())


def get_batch(db: Engine, tenant: str | None, batch_id: str) -> BatchInfo | None:
    """The batch, or None if it is not the tenant's (``tenant`` None: whoever's it is)."""
    query = select(_BATCHES).where(_BATCHES.c.id == batch_id)
    if tenant is not None:
        query = query.where(_BATCHES.c.tenant == tenant)
    with db.connect() as connection:
        row = connection.execute(query).first()
        if row is None:
            return None
        return _info(row, _counts(connection, [batch_id]).get(batch_id, {}))


def list_batches(db: Engine, tenant: str, after: str | None, limit: int) -> tuple[list[BatchInfo], bool]:
    """The tenant's batches newest first, after the cursor ``after``; and whether more follow."""
    c = _BATCHES.c
    query = select(_BATCHES).where(c.tenant == tenant)
    with db.connect() as connection:
        if after is not None:
            cursor = connection.execute(select(c.created_at).where(c.id == after, c.tenant == tenant)).scalar()
            if cursor is not None:
                query = query.where((c.created_at < cursor) | ((c.created_at == cursor) & (c.id < after)))
        rows = connection.execute(query.order_by(c.created_at.desc(), c.id.desc()).limit(limit + 1)).all()
        counts = _counts(connection, [row.id for row in rows[:limit]])
    return [_info(row, counts.get(row.id, {})) for row in rows[:limit]], len(rows) > limit


def cancel_batch(db: Engine, tenant: str, batch_id: str) -> BatchInfo | None:
    """Stop feeding the batch's lines: queued ones are cancelled, running ones finish and are kept.

    The batch is ``cancelling`` until no line runs; the driver's finalization then makes it ``cancelled``.
    A batch already ended is returned as it is."""
    now = int(time.time())
    with db.begin() as connection:
        changed = connection.execute(
            update(_BATCHES).where(_BATCHES.c.id == batch_id, _BATCHES.c.tenant == tenant,
                                   _BATCHES.c.status.in_(("validating", "in_progress")))
            .values(status="cancelling", cancelling_at=now)).rowcount
        if changed:
            connection.execute(update(_LINES).where(_LINES.c.batch_id == batch_id, _LINES.c.state == "queued")
                               .values(state="cancelled", finished_at=now))
    return get_batch(db, tenant, batch_id)


def _counts(connection: Connection, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    if not batch_ids:
        return {}
    rows = connection.execute(select(_LINES.c.batch_id, _LINES.c.state, func.count())
                              .where(_LINES.c.batch_id.in_(batch_ids)).group_by(_LINES.c.batch_id, _LINES.c.state))
    counts: dict[str, dict[str, int]] = {}
    for batch_id, state, n in rows:
        counts.setdefault(batch_id, {})[state] = n
    return counts


def _info(row, counts: dict[str, int]) -> BatchInfo:
    return BatchInfo(
        id=row.id, tenant=row.tenant, endpoint=row.endpoint, input_file_id=row.input_file_id,
        completion_window=row.completion_window, status=row.status,
        metadata=None if row.metadata_json is None else json.loads(row.metadata_json),
        errors=None if row.errors_json is None else json.loads(row.errors_json),
        output_file_id=row.output_file_id, error_file_id=row.error_file_id, total=row.total,
        reserved_tokens=row.reserved_tokens, times={name: getattr(row, name) for name in TIMES}, counts=counts)
