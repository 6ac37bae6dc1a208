"""Chaos: a bounded load of both tiers against a real `tiergate serve` while what it depends on fails.

    .venv/bin/python -m bench.live.chaos [--json bench/out/chaos.json] [--concurrency 6] [--phase-s 8]

All on loopback: PostgreSQL (a fresh schema of the `test` database) reached through a TCP proxy
that is cut, a private redis-server that is restarted, and the server itself (a subprocess on a
tiny random Llama) SIGKILLed and started again. One fault per phase, each under the same load of
premium and standard tenants, half of the requests streamed; then 100 streams whose clients
leave after the first chunk. Per phase: requests sent, answered by status, 5xx other than 503,
KV blocks still held once the server is idle, and ledger rows missing or doubled against the
requests whose id the clients saw (a row must exist, closed, for each; `interrupted` is a closed
row). Goal: 0 non-503 5xx, 0 leaked, 0 missing, 0 doubled. Connection errors (the server being
killed, or down until it restarts) are counted apart: they are not answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from bench.common import paths, report
from tests.support.faults import PrivateRedis, TcpProxy, free_port

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_ADMIN_URL = f"postgresql://postgres@{PG_HOST}:{PG_PORT}/test"
TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip
GOALS = {"non_503_5xx": 0, "kv_blocks_leaked": 0, "rows_missing": 0, "rows_doubled": 0}


@dataclass
class Outcome:
    """One request as its client saw it."""

    status: str  # an HTTP status, or "connection error"
    request_id: str | None = None  # from the response (JSON id, or the stream's first chunk)
    completion_tokens: int | None = None  # from usage, when the response was complete


@dataclass
class PhaseResult:
    fault: str
    sent: int = 0
    answered: dict[str, int] = field(default_factory=dict)
    non_503_5xx: int = 0
    connection_errors: int = 0
    kv_blocks_leaked: int = 0
    rows_missing: int = 0
    rows_doubled: int = 0
    tokens_differ: int = 0  # complete responses whose row bills other completion tokens than the client got
    interrupted_rows: int = 0


class Server:
    """`tiergate serve` as a subprocess, started again on the same port and database after a kill."""

    def __init__(self, model_dir: Path, env: dict[str, str]) -> None:
        self.model_dir = model_dir
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", f"dummy:{self.model_dir}", "--port",
             str(self.port)], cwd=paths.ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tiergate serve exited during startup")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("tiergate serve did not become ready")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


async def one_request(client: httpx.AsyncClient, url: str, key: str, model: str, stream: bool, n: int,
                      max_tokens: int = 8, leave_after_first_chunk: bool = False) -> Outcome:
    body = {"model": model, "prompt": f"chaos {n}", "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {key}"}
    outcome = Outcome("connection error")
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body, headers=headers)
            outcome.status = str(r.status_code)
            if r.status_code == 200:
                data = r.json()
                outcome.request_id, outcome.completion_tokens = data["id"], data["usage"]["completion_tokens"]
            return outcome
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            outcome.status = str(r.status_code)
            if r.status_code != 200:
                await r.aread()
                return outcome
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                outcome.request_id = chunk.get("id", outcome.request_id)
                if leave_after_first_chunk:
                    return outcome  # closing the response drops the connection mid-stream
                if chunk.get("usage"):
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.TransportError, json.JSONDecodeError):
        outcome.status = "connection error" if outcome.request_id is None else "connection lost mid-stream"
    return outcome


async def load(url: str, keys: list[str], model: str, concurrency: int, stop: asyncio.Event,
               outcomes: list[Outcome]) -> None:
    """`concurrency` clients, each one request at a time, alternating tenants and streaming, until `stop`."""
    async def client_loop(worker: int) -> None:
        n = worker
        async with httpx.AsyncClient(timeout=60) as client:
            while not stop.is_set():
                outcome = await one_request(client, url, keys[n % len(keys)], model, stream=n % 2 == 0, n=n)
                outcomes.append(outcome)
                n += concurrency
                if outcome.status.startswith("connection") or outcome.status in ("503", "429"):
                    await asyncio.sleep(0.2)  # what a client with back-off does; keeps a dead server from a spin

    await asyncio.gather(*(client_loop(w) for w in range(concurrency)))


async def drop_streams(url: str, key: str, model: str, count: int, outcomes: list[Outcome]) -> None:
    """`count` streams whose clients leave after the first chunk, 20 at a time."""
    for first in range(0, count, 20):
        async with httpx.AsyncClient(timeout=60) as client:
            outcomes += await asyncio.gather(*(
                one_request(client, url, key, model, stream=True, n=100_000 + i, max_tokens=200,
                            leave_after_first_chunk=True)
                for i in range(first, min(count, first + 20))))


def idle_kv_blocks(url: str, timeout_s: float = 60) -> int:
    """KV blocks held once the server has nothing running or waiting (all of them, if it never gets there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = _metrics(url)
        busy = metrics.get("tiergate_num_requests_running", 0) + metrics.get("tiergate_num_requests_waiting", 0)
        if busy == 0 or time.monotonic() > deadline:
            return int(metrics.get("tiergate_kv_blocks_used", 0))
        time.sleep(0.2)


def _metrics(url: str) -> dict[str, float]:
    """Each series' value summed over its labels."""
    totals: Counter[str] = Counter()
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            totals[name_labels.split("{")[0]] += float(value)
    return dict(totals)


def check_ledger(database_url: str, outcomes: list[Outcome], result: PhaseResult, timeout_s: float = 30) -> None:
    """Rows against what the clients saw, once the spool and the orphan sweep have had their time."""
    seen = {o.request_id: o for o in outcomes if o.request_id is not None}
    engine = create_engine(database_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with engine.connect() as c:
                rows = c.execute(text("SELECT request_id, status, completion_tokens FROM usage_ledger "
                                      "WHERE request_id = ANY(:ids)"), {"ids": list(seen)}).all()
            closed = {r.request_id for r in rows if r.status != "open"}
            if closed >= set(seen) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        counts = Counter(r.request_id for r in rows)
        result.rows_missing = len(set(seen) - closed)
        result.rows_doubled = sum(n - 1 for n in counts.values() if n > 1)
        result.interrupted_rows = sum(1 for r in rows if r.status == "interrupted")
        result.tokens_differ = sum(1 for r in rows if seen[r.request_id].completion_tokens is not None
                                   and r.completion_tokens != seen[r.request_id].completion_tokens)
    finally:
        engine.dispose()


async def run_phase(fault: str, cause: Callable[[list[Outcome]], Awaitable[None]], server: Server, keys: list[str],
                    model: str, database_url: str, concurrency: int, phase_s: float) -> PhaseResult:
    """Load for `phase_s` with `cause(outcomes)` set off a second in (it may add requests of its own)."""
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    load_task = asyncio.create_task(load(server.url, keys, model, concurrency, stop, outcomes))
    started = time.monotonic()
    await asyncio.sleep(min(1.0, phase_s / 4))
    await cause(outcomes)
    # Load goes on after the fault is over (a restarted server, a restored database) for half a phase at least.
    await asyncio.sleep(max(phase_s / 2, phase_s - (time.monotonic() - started)))
    stop.set()
    await load_task
    result = PhaseResult(fault, sent=len(outcomes))
    statuses = Counter(o.status for o in outcomes)
    result.answered = {s: n for s, n in sorted(statuses.items()) if not s.startswith("connection")}
    result.connection_errors = sum(n for s, n in statuses.items() if s.startswith("connection"))
    result.non_503_5xx = sum(n for s, n in statuses.items() if s.startswith("5") and s != "503")
    result.kv_blocks_leaked = await asyncio.to_thread(idle_kv_blocks, server.url)
    await asyncio.to_thread(check_ledger, database_url, outcomes, result)
    return result


def set_up_database(schema: str, url: str) -> tuple[str, str]:
    """Tenants and keys in a fresh schema: (premium key, standard key)."""
    from billing.db import create_engine_for, upgrade
    from billing.keys import create_key
    from billing.tenants import create_tenant

    upgrade(url)
    db = create_engine_for(url)
    try:
        limits = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": 1000}
        create_tenant(db, "chaos-premium", "premium", **limits)
        create_tenant(db, "chaos-standard", "standard", **limits)
        return create_key(db, "chaos-premium")[1], create_key(db, "chaos-standard")[1]
    finally:
        db.dispose()


async def chaos(concurrency: int, phase_s: float, tmp: Path) -> list[PhaseResult]:
    schema = f"tg_chaos_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    proxy = TcpProxy(PG_HOST, PG_PORT)
    redis = PrivateRedis(tmp)
    server: Server | None = None
    try:
        options = f"?options=-csearch_path%3D{schema}"
        direct_url = f"{PG_ADMIN_URL}{options}"
        keys = list(set_up_database(schema, direct_url))
        model_dir = tmp / "tiny"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
        env = {**os.environ, "PYTHONPATH": str(paths.ROOT),
               "TIERGATE_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{proxy.port}/test{options}",
               "TIERGATE_REDIS_URL": redis.url, "TIERGATE_SPOOL_PATH": str(tmp / "spool.jsonl"),
               "TIERGATE_AUTH_CACHE_TTL_S": "1", "TIERGATE_LEDGER_CHECKPOINT_S": "0.5",
               "TIERGATE_LOG_LEVEL": "warning"}
        server = Server(model_dir, env)
        await asyncio.to_thread(server.start)
        model = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {keys[0]}"}).json()
        model = model["data"][0]["id"]

        async def nothing(_: list[Outcome]) -> None:
            pass

        async def cut_database(_: list[Outcome]) -> None:
            proxy.cut()
            await asyncio.sleep(phase_s / 2)
            proxy.restore()

        async def restart_redis(_: list[Outcome]) -> None:
            await asyncio.to_thread(redis.restart)

        async def kill_and_restart_server(_: list[Outcome]) -> None:
            server.kill()
            await asyncio.to_thread(server.start)

        async def drop_100_streams(outcomes: list[Outcome]) -> None:
            await drop_streams(server.url, keys[1], model, 100, outcomes)
        phases = [("none (baseline)", nothing), ("database cut", cut_database), ("Redis restarted", restart_redis),
                  ("server SIGKILLed and restarted", kill_and_restart_server),
                  ("100 streams dropped by their clients", drop_100_streams)]
        results = []
        for fault, cause in phases:
            result = await run_phase(fault, cause, server, keys, model, direct_url, concurrency, phase_s)
            print(format_row(result), flush=True)
            results.append(result)
        return results
    finally:
        if server is not None:
            server.stop()
        redis.stop()
        proxy.close()
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


HEADER = ("| fault | sent | answered by status | 5xx other than 503 | connection errors | KV blocks leaked "
          "| rows missing | rows doubled | rows billing other tokens than the client got | rows interrupted |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: PhaseResult) -> str:
    answered = ", ".join(f"{s}: {n}" for s, n in r.answered.items()) or "-"
    return (f"| {r.fault} | {r.sent} | {answered} | {r.non_503_5xx} | {r.connection_errors} | {r.kv_blocks_leaked} "
            f"| {r.rows_missing} | {r.rows_doubled} | {r.tokens_differ} | {r.interrupted_rows} |")


def render_markdown(result: dict) -> str:
    phases = [PhaseResult(**p) for p in result["phases"]]
    totals = {k: sum(getattr(p, k) for p in phases) for k in GOALS}
    verdict = ", ".join(f"{k.replace('_', ' ')} {v} (goal {GOALS[k]})" for k, v in totals.items())
    return "\n".join([
        f"Load: {result['concurrency']} clients, {result['phase_s']} s a phase, both tiers, half streamed; "
        f"wall {result['wall_s']:.0f} s.", "", HEADER, *(format_row(p) for p in phases), "", f"Totals: {verdict}.",
    ])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--phase-s", type=float, default=8.0)
    p.add_argument("--json", default="bench/out/chaos.json")
    args = p.parse_args(argv)
    started = time.monotonic()
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="tiergate-chaos-") as tmp:
        phases = asyncio.run(chaos(args.concurrency, args.phase_s, Path(tmp)))
    result = {"concurrency": args.concurrency, "phase_s": args.phase_s, "wall_s": time.monotonic() - started,
              "phases": [asdict(p) for p in phases], "goals": GOALS}
    report.finish(result, args.json, render_markdown)
    return result


if __name__ == "__main__":
    main()
