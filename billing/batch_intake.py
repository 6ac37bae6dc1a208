"""A batch from ``validating`` to ``in_progress`` or ``failed``: its validation claimed under a lease, its lines
stored as they pass, the tenant's queue limit checked when they are all in.

``POST /v1/batches`` only records the batch (``validating``); a replica's driver then claims it
(``claim_validation``), as it claims lines: the lease (``validation_owner``, ``validation_until``)
is renewed while the lines are checked, and a replica that dies leaves the batch to whoever
claims it after the lease ran out, which first drops the lines the dead one stored. Lines are
stored in small groups while the check goes on (``add_lines``, only while the lease is the
writer's), so a file of 50,000 lines is never held whole; they stay unclaimable until
``finish_validation`` makes the batch ``in_progress``, in the transaction that checks the tenant's
``batch_queue_tokens`` against the tokens its unfinished batches hold.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, insert, or_, select, update

from billing.batch_models import Batch, BatchLine
from billing.batches import LineSpec, unfinished_tokens

_BATCHES = Batch.__table__
_LINES = BatchLine.__table__
QUEUE_LIMIT_CODE = "batch_token_limit_exceeded"


@dataclass(frozen=True)
class ValidatingBatch:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str


def _claimable(now: float):
    b = _BATCHES.c
    return and_(b.status == "validating", or_(b.validation_owner.is_(None), b.validation_until < now))


def claim_validation(db: Engine, owner: str, lease_s: float, now: float | None = None) -> ValidatingBatch | None:
    """Lease the oldest batch waiting for validation (never claimed, or its validator's lease ran out) to ``owner``;
    lines an earlier validator stored are dropped, so the check starts over. Of replicas racing, one gets it."""
    now = time.time() if now is None else now
    b = _BATCHES.c
    with db.begin() as connection:
        for row in connection.execute(select(b.id, b.tenant, b.endpoint, b.input_file_id).where(_claimable(now))
                                      .order_by(b.created_at, b.id).limit(4)).all():
            taken = connection.execute(update(_BATCHES).where(b.id == row.id, _claimable(now))
                                       .values(validation_owner=owner, validation_until=now + lease_s)).rowcount
            if taken:
                connection.execute(delete(_LINES).where(_LINES.c.batch_id == row.id))
                return ValidatingBatch(*row)
    return None


def _hold(connection: Connection, owner: str, batch_id: str, lease_s: float) -> bool:
    """Extend ``owner``'s validation lease on the batch; False if it is no longer owner's to validate."""
    b = _BATCHES.c
    return bool(connection.execute(
        update(_BATCHES).where(b.id == batch_id, b.status == "validating", b.validation_owner == owner)
        .values(validation_until=time.time() + lease_s)).rowcount)


def renew_validation(db: Engine, owner: str, batch_id: str, lease_s: float) -> bool:
    with db.begin() as connection:
        return _hold(connection, owner, batch_id, lease_s)


def add_lines(db: Engine, owner: str, batch_id: str, lines: list[LineSpec], lease_s: float) -> bool:
    """Store checked lines (queued, but not claimable while the batch validates) and renew the lease; False, and
    nothing stored, once the batch is no longer ``owner``'s to validate."""
    with db.begin() as connection:
        if not _hold(connection, owner, batch_id, lease_s):
            return False
        if lines:
            connection.execute(insert(_LINES), [
                {"batch_id": batch_id, "line": spec.line, "custom_id": spec.custom_id, "body": spec.body,
                 "state": "queued", "attempts": 0} for spec in lines])
    return True


def release_validation(db: Engine, owner: str, batch_id: str) -> None:
    """Give the batch's validation up (the replica stops): any replica may claim it at once."""
    b = _BATCHES.c
    with db.begin() as connection:
        connection.execute(update(_BATCHES).where(b.id == batch_id, b.status == "validating",
                                                  b.validation_owner == owner)
                           .values(validation_owner=None, validation_until=None))


def finish_validation(db: Engine, owner: str, batch_id: str, errors: list[dict[str, Any]], total: int,
                      reserved: int) -> str | None:
    """End the validation: ``failed`` with ``errors`` when a line is at fault or the batch's ``reserved`` tokens do
    not fit the tenant's queue limit beside its other unfinished batches, else ``in_progress`` with the lines
    stored. Returns the status, or None if the batch was no longer ``owner``'s (cancelled, taken over)."""
    now = int(time.time())
    b = _BATCHES.c
    with db.begin() as connection:
        query = select(b.tenant).where(b.id == batch_id, b.status == "validating", b.validation_owner == owner)
        if connection.dialect.name == "postgresql":  # a cancel waits for this to end (SQLite serializes writers)
            query = query.with_for_update()
        tenant = connection.execute(query).scalar()
        if tenant is None:
            return None
        if not errors:
            limit, held = unfinished_tokens(connection, tenant, exclude=batch_id)
            if held + reserved > limit:
                errors = [{"code": QUEUE_LIMIT_CODE, "param": None, "line": None, "message": (
                    f"Enqueued token limit reached: this batch needs {reserved} tokens (prompts plus max_tokens) and "
                    f"your unfinished batches hold {held} of your limit of {limit}. Wait for them to finish, or "
                    "send a smaller batch.")}]
        done = update(_BATCHES).where(b.id == batch_id, b.status == "validating", b.validation_owner == owner)
        if errors:
            connection.execute(delete(_LINES).where(_LINES.c.batch_id == batch_id))
            connection.execute(done.values(status="failed", errors_json=json.dumps(errors), total=total,
                                           failed_at=now, validation_owner=None, validation_until=None))
            return "failed"
        connection.execute(done.values(status="in_progress", total=total, reserved_tokens=reserved,
                                       in_progress_at=now, validation_owner=None, validation_until=None))
        return "in_progress"
