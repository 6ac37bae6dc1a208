"""Clients that leave before their answer: their requests are aborted, their KV blocks freed, and each is billed."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
from sqlalchemy import text

from scheduler.config import TierConfig


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def ledger_rows(server) -> dict[str, tuple[str, int]]:
    with server.db.connect() as c:
        rows = c.execute(text("SELECT request_id, status, completion_tokens FROM usage_ledger"))
        return {r[0]: (r[1], r[2]) for r in rows}


def kv_blocks_held(server) -> int:
    used_by_tier, _ = server.engine.kv_usage()
    return sum(used_by_tier.values())


def test_disconnect_storm_frees_every_kv_block_and_bills_every_request(serve, make_engine):
    # No TTFT SLO: on a shared CPU, 64 open streams would rightly trip admission control,
    # and this test is about what happens to the ones that were admitted.
    tiers = (TierConfig("premium", 0, None, 0.3), TierConfig("standard", 1, None))
    server = serve(engine=make_engine(tiers=tiers))
    key = server.add_tenant("acme", "premium", rpm=100_000, tpm=100_000_000, max_concurrent=1000)
    rng = random.Random(7)
    n = 200
    model = server.engine.model_name

    async def one(http: httpx.AsyncClient, i: int) -> str | None:
        body = {"model": model, "prompt": f"storm {i}", "max_tokens": 64, "stream": True}
        cut_after = rng.randint(0, 12)  # events read before hanging up; 0 is right after the headers
        async with http.stream("POST", server.url + "/v1/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= cut_after:
                    break
            # leaving the block closes the connection mid-stream
        return request_id

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            return await asyncio.gather(*[one(http, i) for i in range(n)])

    request_ids = asyncio.run(storm())
    assert len(set(request_ids)) == n
    assert wait_until(lambda: server.gateway.lifecycle.in_flight == 0 and not server.gateway.lifecycle._tasks)
    assert wait_until(lambda: kv_blocks_held(server) == 0)
    rows = ledger_rows(server)
    assert set(request_ids) <= set(rows)
    statuses = {rows[r][0] for r in request_ids}
    assert statuses <= {"cancelled", "ok"} and "cancelled" in statuses
    assert any(rows[r][0] == "cancelled" and rows[r][1] > 0 for r in request_ids)


def test_finished_stream_has_its_ledger_row_before_done(server):
    model = server.engine.model_name
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions",
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 5, "stream": True},
                         headers={"authorization": f"Bearer {server.keys['globex']}"}) as r:
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    # The row is committed before the last byte is sent.
                    assert ledger_rows(server)[request_id] == ("ok", 5)
                    break
            else:
                raise AssertionError("no [DONE]")


def test_a_client_leaving_a_non_streaming_request_aborts_it(server):
    model = server.engine.model_name
    body = json.dumps({"model": model, "prompt": "leave", "max_tokens": 240, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.keys['acme']}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    port = int(server.url.rsplit(":", 1)[1])
    before = set(ledger_rows(server))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        assert wait_until(lambda: kv_blocks_held(server) > 0, timeout_s=10)
    # Gone before its 240 tokens: the engine drops the request and the ledger bills what it made.
    assert wait_until(lambda: kv_blocks_held(server) == 0)
    assert wait_until(lambda: len(set(ledger_rows(server)) - before) == 1)
    (request_id,) = set(ledger_rows(server)) - before
    status, completion_tokens = ledger_rows(server)[request_id]
    assert status == "cancelled" and completion_tokens < 240
