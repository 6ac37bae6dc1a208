"""Running a batch's lines across replicas: claims with leases, results written once, batches finalized.

A replica claims a few lines at a time (``claim``): a queued line, or a leased one whose lease ran
out (its replica died or stalled), becomes ``leased`` to it until ``lease_until``, which it renews
while the line runs. ``finish_line`` writes the line's result and its ledger row in one
transaction, and only while the lease is still the writer's: a line is answered once and billed
once whatever dies when. ``finalize`` ends batches with nothing left to run (completed, or
cancelled, or expired past their window, with the results so far) and writes their output and
error files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Engine, and_, func, or_, select, update

from billing.batch_files import insert_file
from billing.batch_models import Batch, BatchLine
from billing.ledger_rows import insert_records
from billing.usage_record import UsageRecord

_BATCHES = Batch.__table__
_LINES = BatchLine.__table__


@dataclass(frozen=True)
class ClaimedLine:
    batch_id: str
    line: int
    custom_id: str
    body: str
    tenant: str
    endpoint: str
    attempts: int  # this claim included

    @property
    def key(self) -> tuple[str, int]:
        return (self.batch_id, self.line)


def _claimable(now: float):
    return or_(_LINES.c.state == "queued", and_(_LINES.c.state == "leased", _LINES.c.lease_until < now))


def claim(db: Engine, owner: str, limit: int, lease_s: float, now: float | None = None) -> list[ClaimedLine]:
    """Lease up to ``limit`` lines of running batches to ``owner``.

    Candidates are taken line number first across batches, so every batch (and tenant) with work gets
    lines into the window and the engine's fair share decides between them. Each is leased by an update
    that re-checks it is still claimable, so of replicas racing for a line exactly one gets it."""
    if limit <= 0:
        return []
    now = time.time() if now is None else now
    b, c = _BATCHES.c, _LINES.c
    with db.begin() as connection:
        candidates = connection.execute(
            select(c.batch_id, c.line, c.custom_id, c.body, b.tenant, b.endpoint, c.attempts + 1)
            .join(_BATCHES, b.id == c.batch_id)
            .where(b.status == "in_progress", b.expires_at > int(now), _claimable(now))
            .order_by(c.line, b.created_at).limit(limit * 3)).all()
        claimed: list[ClaimedLine] = []
        for row in candidates:
            if len(claimed) == limit:
                break
            taken = connection.execute(
                update(_LINES).where(c.batch_id == row.batch_id, c.line == row.line, _claimable(now))
                .values(state="leased", lease_owner=owner, lease_until=now + lease_s, attempts=c.attempts + 1)
            ).rowcount
            if taken:
                claimed.append(ClaimedLine(*row))
    return claimed


def renew(db: Engine, owner: str, keys: list[tuple[str, int]], lease_s: float) -> None:
    """Extend the leases ``owner`` still holds on these lines."""
    if not keys:
        return
    c = _LINES.c
    with db.begin() as connection:
        for batch_id, line in keys:
            connection.execute(update(_LINES).where(c.batch_id == batch_id, c.line == line, c.state == "leased",
                                                    c.lease_owner == owner)
                               .values(lease_until=time.time() + lease_s))


def finish_line(db: Engine, owner: str, key: tuple[str, int], succeeded: bool, request_id: str, result: str,
                record: UsageRecord | None) -> bool:
    """Write the line's result and its ledger row together if ``owner`` still holds its lease; False if not
    (another replica took it over, and its result is the one that counts)."""
    c = _LINES.c
    batch_id, line = key
    with db.begin() as connection:
        written = connection.execute(
            update(_LINES).where(c.batch_id == batch_id, c.line == line, c.state == "leased", c.lease_owner == owner)
            .values(state="succeeded" if succeeded else "failed", request_id=request_id, result=result,
                    finished_at=int(time.time()), lease_owner=None, lease_until=None)).rowcount
        if written and record is not None:
            insert_records(connection, [record])
    return bool(written)


def release(db: Engine, owner: str, keys: list[tuple[str, int]], counted: bool = True) -> None:
    """Give lines back unanswered: queued again for any replica. ``counted`` False takes back the attempt their
    claim counted (the replica stopped them, or put them off), so only runs that failed count toward the cap."""
    c = _LINES.c
    attempts = c.attempts if counted else c.attempts - 1
    with db.begin() as connection:
        for batch_id, line in keys:
            connection.execute(update(_LINES).where(c.batch_id == batch_id, c.line == line, c.state == "leased",
                                                    c.lease_owner == owner)
                               .values(state="queued", lease_owner=None, lease_until=None, attempts=attempts))


def finalize(db: Engine, now: float | None = None) -> list[str]:
    """End every batch with nothing left to run; returns the ids of those this call ended.

    A running batch ends when no line is queued or leased; a cancelling one, or one past its window,
    when no line is under a live lease (what is left is marked cancelled or expired). The status goes
    to ``finalizing`` first, then to the final one with the output files in one transaction, so a batch
    left ``finalizing`` by a replica that died is finished by the next call anywhere."""
    now = time.time() if now is None else now
    b, c = _BATCHES.c, _LINES.c
    with db.connect() as connection:
        batches = connection.execute(select(b.id, b.status, b.expires_at)
                                     .where(b.status.in_(("in_progress", "cancelling", "finalizing")))).all()
        pending = dict(connection.execute(
            select(c.batch_id, func.count()).where(c.batch_id.in_([row.id for row in batches]),
                                                   c.state.in_(("queued", "leased"))).group_by(c.batch_id)).all()) \
            if batches else {}
        live = dict(connection.execute(
            select(c.batch_id, func.count()).where(c.batch_id.in_([row.id for row in batches]), c.state == "leased",
                                                   c.lease_until >= now).group_by(c.batch_id)).all()) \
            if batches else {}
    ended = []
    for row in batches:
        if row.status != "finalizing":
            leftover = None
            if row.status == "cancelling":
                leftover = "cancelled"
            elif row.expires_at is not None and row.expires_at <= now:
                leftover = "expired"
            elif pending.get(row.id, 0):
                continue
            if live.get(row.id, 0):
                continue
            if not _start_finalizing(db, row.id, row.status, leftover, now):
                continue
        if _write_outputs(db, row.id, now):
            ended.append(row.id)
    return ended


def _start_finalizing(db: Engine, batch_id: str, status: str, leftover: str | None, now: float) -> bool:
    b, c = _BATCHES.c, _LINES.c
    with db.begin() as connection:
        if not connection.execute(update(_BATCHES).where(b.id == batch_id, b.status == status)
                                  .values(status="finalizing", finalizing_at=int(now))).rowcount:
            return False
        if leftover is not None:  # queued lines, and leased ones whose replica is gone
            connection.execute(update(_LINES).where(c.batch_id == batch_id, c.state.in_(("queued", "leased")))
                               .values(state=leftover, finished_at=int(now), lease_owner=None, lease_until=None))
    return True


class _Lost(Exception):
    """Another replica finished the batch first; raised to roll back the files written meanwhile."""


def _write_outputs(db: Engine, batch_id: str, now: float) -> bool:
    try:
        _write_outputs_once(db, batch_id, now)
    except _Lost:
        return False
    return True


def _write_outputs_once(db: Engine, batch_id: str, now: float) -> None:
    b, c = _BATCHES.c, _LINES.c
    with db.begin() as connection:
        batch = connection.execute(select(b.tenant, b.cancelling_at).where(b.id == batch_id,
                                                                           b.status == "finalizing")).first()
        if batch is None:
            raise _Lost
        rows = connection.execute(select(c.state, c.result).where(c.batch_id == batch_id).order_by(c.line)).all()
        states = {state for state, _ in rows}
        final = "expired" if "expired" in states else "cancelled" if batch.cancelling_at is not None else "completed"
        files = {}
        for state, name in (("succeeded", "output"), ("failed", "error")):
            lines = [result for s, result in rows if s == state]
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                files[name] = insert_file(connection, batch.tenant, "batch_output", f"{batch_id}_{name}.jsonl",
                                          content, len(lines)).id
        done = connection.execute(
            update(_BATCHES).where(b.id == batch_id, b.status == "finalizing")
            .values(status=final, output_file_id=files.get("output"), error_file_id=files.get("error"),
                    **{f"{final}_at": int(now)})).rowcount
        if not done:  # another replica finished it meanwhile: drop the files written here
            raise _Lost


def counts(db: Engine) -> tuple[dict[str, int], dict[str, int]]:
    """(lines by state, batches by status), for the metrics."""
    with db.connect() as connection:
        lines = dict(connection.execute(select(_LINES.c.state, func.count()).group_by(_LINES.c.state)).all())
        batches = dict(connection.execute(select(_BATCHES.c.status, func.count())
                                          .group_by(_BATCHES.c.status)).all())
    return lines, batches
