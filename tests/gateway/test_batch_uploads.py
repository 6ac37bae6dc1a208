"""``POST /v1/files`` streams an upload to its store in bounded memory, on SQLite and PostgreSQL: a file of 44 MB
grows the process's traced memory by a small fraction of its size (tracemalloc, in process: the server
runs in this process's thread), comes back byte for byte, and a file refused midway leaves nothing stored."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func, select

from billing.batch_models import BatchFile, BatchFileChunk
from tests.gateway.both_databases import database_url  # noqa: F401 (a fixture: these run on both databases)

BOUNDARY = "tiergateboundary"
MB = 1 << 20


def line_bytes(i: int, model: str) -> bytes:
    # About 4 KB a line: tens of megabytes stay within OpenAI's 50,000 lines.
    return json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": 4,
                                "messages": [{"role": "user", "content": f"{i} " + "x" * 4000}]}}).encode() + b"\n"


def multipart(lines: Iterator[bytes]) -> Iterator[bytes]:
    """A multipart body around ``lines``, made as it is sent (the test holds no copy of the file)."""
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
           f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
           f'Content-Type: application/jsonl\r\n\r\n').encode()
    yield from lines
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def post_file(live, lines: Iterator[bytes]) -> httpx.Response:
    return httpx.post(live.url + "/v1/files", content=multipart(lines), timeout=600,
                      headers={"authorization": f"Bearer {live.keys['acme']}",
                               "content-type": f"multipart/form-data; boundary={BOUNDARY}"})


def stored(live) -> tuple[int, int]:
    with live.db.connect() as connection:
        return (connection.execute(select(func.count()).select_from(BatchFile)).scalar(),
                connection.execute(select(func.count()).select_from(BatchFileChunk)).scalar())


@pytest.fixture
def uploads(serve):
    live = serve(batch_max_file_bytes=200 * MB)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    return live


def test_an_upload_of_tens_of_megabytes_streams_to_the_store_in_bounded_memory(uploads):
    model, count = uploads.engine.model_name, 11_000
    sent = hashlib.sha256()
    size = 0

    def lines() -> Iterator[bytes]:
        nonlocal size
        for start in range(0, count, 16):  # 64 KB a write
            block = b"".join(line_bytes(i, model) for i in range(start, min(start + 16, count)))
            sent.update(block)
            size += len(block)
            yield block

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        answer = post_file(uploads, lines())
        upload_peak = tracemalloc.get_traced_memory()[1] - before
        assert answer.status_code == 200, answer.text
        info = answer.json()
        assert size > 40 * 10**6 and info["bytes"] == size
        received = hashlib.sha256()
        tracemalloc.reset_peak()
        with httpx.stream("GET", f"{uploads.url}/v1/files/{info['id']}/content", timeout=600,
                          headers={"authorization": f"Bearer {uploads.keys['acme']}"}) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                received.update(chunk)
        download_peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert received.hexdigest() == sent.hexdigest()
    # A chunk of the spool, a row, a line and the parser's buffers: a few megabytes whatever the file's size (the
    # whole file held once would be more than all of it).
    assert upload_peak < size / 5, (upload_peak, size)
    assert download_peak < size / 5, (download_peak, size)
    with uploads.db.connect() as connection:
        assert connection.execute(select(BatchFile.line_count).where(BatchFile.id == info["id"])).scalar() == count


def test_a_file_over_the_limit_found_while_storing_is_a_413_and_leaves_nothing_stored(serve):
    limit_mb = 3
    # Just over the limit, inside the multipart framing's allowance: refused only once its chunks are being stored.
    live = serve(batch_max_file_bytes=limit_mb * MB)
    live.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    model = live.engine.model_name
    lines, size = [], 0
    while size <= limit_mb * MB + 1000:
        lines.append(line_bytes(len(lines), model))
        size += len(lines[-1])
    answer = post_file(live, iter(lines))
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "file_too_large"
    assert stored(live) == (0, 0)


def test_a_line_that_is_not_json_deep_in_a_large_file_is_a_400_and_leaves_nothing_stored(uploads):
    model = uploads.engine.model_name

    def lines() -> Iterator[bytes]:
        for i in range(2000):  # 8 MB: several chunks are written before the bad line is read
            yield line_bytes(i, model)
        yield b"not json\n"

    answer = post_file(uploads, lines())
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_jsonl" and "line 2001" in error["message"]
    assert stored(uploads) == (0, 0)
