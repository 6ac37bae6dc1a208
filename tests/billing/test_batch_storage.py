"""The Batch API's storage on SQLite and PostgreSQL: files as chunks (and migration 0007 moving stored files into
them and back), the validation lease, attempts, and the per-tenant batch queue limit."""

from __future__ import annotations

import time

import pytest
from alembic import command
from sqlalchemy import select, text

from billing import batch_files, batch_intake, batch_lines, batches, tenants
from billing.batch_models import BatchLine
from billing.db import alembic_config, create_engine_for, upgrade
from billing.errors import InvalidLimit
from billing.models import DEFAULT_BATCH_QUEUE_TOKENS

CHAT = "/v1/chat/completions"


def test_migration_0007_moves_stored_files_into_chunks_and_back(empty_db_url):
    upgrade(empty_db_url, "0006")
    engine = create_engine_for(empty_db_url)
    content = bytes(range(256)) * (10 * 1024) + b"tail"  # 2.5 MB: three chunks
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (name, tier, rpm, tpm, max_concurrent, weight, version, "
                                "created_at, updated_at) VALUES ('acme', 'standard', 1, 1, 1, 1, 1, "
                                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        connection.execute(text("INSERT INTO batch_files (id, tenant, purpose, filename, bytes, line_count, "
                                "created_at, content) VALUES ('file-old', 'acme', 'batch', 'a.jsonl', :n, 1, 0, :c)"),
                           {"n": len(content), "c": content})
    upgrade(empty_db_url)
    assert b"".join(batch_files.file_chunks(engine, "acme", "file-old")) == content
    assert tenants.get_tenant(engine, "acme").batch_queue_tokens == DEFAULT_BATCH_QUEUE_TOKENS
    with engine.begin() as connection:
        cfg = alembic_config()
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0006")
    with engine.connect() as connection:
        assert bytes(connection.execute(text("SELECT content FROM batch_files")).scalar()) == content
    engine.dispose()


def test_a_file_stored_from_chunks_reads_back_whole_and_a_failing_source_stores_nothing(engine):
    tenants.create_tenant(engine, "acme", "standard")
    pieces = [b"a" * 700_000, b"b" * 700_000, b"c\n"]
    info = batch_files.store_file(engine, "acme", "batch", "in.jsonl", pieces, lambda: 1)
    assert info.bytes == 1_400_002
    assert b"".join(batch_files.file_chunks(engine, "acme", info.id)) == b"".join(pieces)
    assert batch_files.file_chunks(engine, "other", info.id) is None

    def failing():
        yield b"x" * (3 << 20)
        raise ValueError("refused midway")

    with pytest.raises(ValueError):
        batch_files.store_file(engine, "acme", "batch", "bad.jsonl", failing(), lambda: 1)
    assert [f.id for f in batch_files.list_files(engine, "acme")[0]] == [info.id]
    assert batch_files.delete_file(engine, "acme", info.id)
    assert batch_files.file_chunks(engine, "acme", info.id) is None


def validating_batch(engine, tenant: str = "acme") -> str:
    file = batch_files.store_file(engine, tenant, "batch", "in.jsonl", [b"{}\n"], lambda: 1)
    return batches.create_batch(engine, tenant, CHAT, file.id, "24h", None, 2, 3600).id


def line(n: int, tokens: int = 10) -> batches.LineSpec:
    return batches.LineSpec(n, f"c{n}", "{}", tokens)


def test_a_validation_is_claimed_once_and_taken_over_only_after_its_lease_dropping_what_it_stored(engine):
    tenants.create_tenant(engine, "acme", "standard")
    batch_id = validating_batch(engine)
    now = time.time()
    assert batch_intake.claim_validation(engine, "a", 5.0, now=now).id == batch_id
    assert batch_intake.claim_validation(engine, "b", 5.0, now=now + 1) is None
    assert batch_intake.add_lines(engine, "a", batch_id, [line(1)], 5.0)
    # a died: after its lease, b starts over without a's line.
    assert batch_intake.claim_validation(engine, "b", 5.0, now=time.time() + 10).id == batch_id
    assert not batch_intake.add_lines(engine, "a", batch_id, [line(2)], 5.0)
    assert batch_intake.finish_validation(engine, "a", batch_id, [], 2, 20) is None
    assert batch_intake.add_lines(engine, "b", batch_id, [line(1), line(2)], 5.0)
    assert batch_intake.finish_validation(engine, "b", batch_id, [], 2, 20) == "in_progress"
    info = batches.get_batch(engine, "acme", batch_id)
    assert (info.status, info.total, info.reserved_tokens) == ("in_progress", 2, 20)
    with engine.connect() as connection:
        assert connection.execute(select(BatchLine.line).where(BatchLine.batch_id == batch_id)
                                  .order_by(BatchLine.line)).scalars().all() == [1, 2]


def test_the_queue_limit_is_the_tenants_own_at_creation_and_at_validation(engine):
    tenants.create_tenant(engine, "acme", "standard", batch_queue_tokens=100)
    first = validating_batch(engine)
    assert batch_intake.claim_validation(engine, "v", 5.0).id == first
    assert batch_intake.add_lines(engine, "v", first, [line(1, 60), line(2, 40)], 5.0)
    assert batch_intake.finish_validation(engine, "v", first, [], 2, 100) == "in_progress"
    with pytest.raises(batches.BatchQueueFull, match="limit of 100"):
        validating_batch(engine)
    tenants.set_tenant(engine, "acme", batch_queue_tokens=150)
    second = validating_batch(engine)
    assert batch_intake.claim_validation(engine, "v", 5.0).id == second
    assert batch_intake.finish_validation(engine, "v", second, [], 1, 60) == "failed"
    [error] = batches.get_batch(engine, "acme", second).errors
    assert error["code"] == "batch_token_limit_exceeded" and error["line"] is None
    with pytest.raises(InvalidLimit):
        tenants.set_tenant(engine, "acme", batch_queue_tokens=0)
    assert tenants.set_tenant(engine, "acme", batch_queue_tokens=2**40).batch_queue_tokens == 2**40


def test_a_run_given_back_uncounted_keeps_its_attempts_and_a_counted_one_adds_one(engine):
    tenants.create_tenant(engine, "acme", "standard")
    batch_id = validating_batch(engine)
    assert batch_intake.claim_validation(engine, "v", 5.0).id == batch_id
    assert batch_intake.add_lines(engine, "v", batch_id, [line(1)], 5.0)
    assert batch_intake.finish_validation(engine, "v", batch_id, [], 1, 10) == "in_progress"
    for _ in range(3):
        [claimed] = batch_lines.claim(engine, "r", 1, 30.0)
        batch_lines.release(engine, "r", [claimed.key], counted=False)
    [claimed] = batch_lines.claim(engine, "r", 1, 30.0)
    assert claimed.attempts == 1
    batch_lines.release(engine, "r", [claimed.key], counted=True)
    assert batch_lines.claim(engine, "r", 1, 30.0)[0].attempts == 2
