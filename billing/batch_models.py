"""The Batch API's tables: uploaded files, batches, and one row per batch line with its lease and result.

Kept in the billing database because every replica sees it: a line is claimed with a lease
(``lease_owner``, ``lease_until``), its result written once by the lease's holder, and a replica
that dies leaves its lines to whoever claims them after the lease runs out. Times are epoch
seconds (OpenAI's objects show integers); a lease's end is a float.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, CheckConstraint, Float, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from billing.models import Base

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
# queued: waits for a claim; leased: a replica runs it until lease_until; succeeded/failed: its result is
# written (output or error file); cancelled/expired: the batch ended before it ran.
LINE_STATES = ("queued", "leased", "succeeded", "failed", "cancelled", "expired")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


class BatchFile(Base):
    """A tenant's file: an uploaded input (purpose ``batch``) or a batch's output or error file."""

    __tablename__ = "batch_files"
    __table_args__ = (Index("ix_batch_files_tenant_created_at", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger)


class BatchFileChunk(Base):
    """A file's bytes in order, a chunk a row: written and read a chunk at a time, so no process holds a whole
    file (200 MB at most) to store or serve it."""

    __tablename__ = "batch_file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("batch_files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint(_one_of("status", BATCH_STATUSES), name="status"),
        Index("ix_batches_tenant_created_at", "tenant", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    metadata_json: Mapped[str | None] = mapped_column(Text)
    errors_json: Mapped[str | None] = mapped_column(Text)  # the validation errors of a failed batch
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer)
    # Prompt plus max_tokens of every line: what counts against the tenant's batch queue limit until it ends.
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    # While ``validating``: the replica checking its lines, until when (renewed as it goes; one that died
    # leaves the batch to whoever claims it after this time).
    validation_owner: Mapped[str | None] = mapped_column(String(128))
    validation_until: Mapped[float | None] = mapped_column(Float)


class BatchLine(Base):
    __tablename__ = "batch_lines"
    __table_args__ = (
        CheckConstraint(_one_of("state", LINE_STATES), name="state"),
        Index("ix_batch_lines_state_batch_id", "state", "batch_id"),
    )

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1-based, as the errors object names it
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[str] = mapped_column(Text)  # the request's JSON body
    state: Mapped[str] = mapped_column(String(16))
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    request_id: Mapped[str | None] = mapped_column(String(128))  # the attempt that wrote the result
    result: Mapped[str | None] = mapped_column(Text)  # the output or error file's JSON line
    finished_at: Mapped[int | None] = mapped_column(BigInteger)
