"""Gateway overhead: the HTTP path's added latency over a direct engine call, and 429s per second.

One run, one tiny random Llama (the tests' shape): a server subprocess serves
it through the full gateway (auth, limits, admission, ledger row before the
last byte, metrics); this process holds a second engine of the same model
and calls it directly. Requests alternate between the two paths so both see
the same machine state; added latency = HTTP percentile - direct percentile.
Alternating also means each request finds the CPU caches holding the other
path's work; the direct path is timed back to back as well, to show what that
costs on the machine at hand.

By default the HTTP path is timed with a minimal keep-alive HTTP/1.1 client,
so that the number is the gateway's: http.client parses response headers with
the email package, about 0.2 ms a request on this CPU, which is the client's
cost (``--client http.client`` measures through it instead).
Then a tenant over its RPM floods the server and we count 429s per second.

Budgets: a tenant with a budget in each unit (tokens, GPU-seconds, USD: every reservation and
settlement a request can cost) and one without alternate on the same server, on one keep-alive
connection each; the budgets' added latency is the difference of their p50s. Budgets are held in
process, or in Redis with ``--redis-url`` (the server's rate limits then go there too, for both).
The budget gate alone (admission and settlement of one request against the same three budgets,
no HTTP) is timed in this process too: on a loaded machine that figure is the steadier one.

The server logs as ``tiergate serve`` does by default: JSON lines at level info,
one access-log line per request (here to a file); ``--log-level warning`` drops
the access log, which is worth about a fifth of the 429 rate on this CPU.

    python -m bench.live.gateway_overhead [--requests 1000] [--flood-seconds 3] [--client raw|http.client]
                                     [--log-level info|warning] [--redis-url URL]
                                     [--out bench/out/gateway_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import paths, report
from bench.live.http_clients import HttpClientPost, RawClient
from bench.common.stats import percentile

GOALS = {"added_p50_ms": 1.0, "added_p99_ms": 5.0, "rejections_per_s": 2000, "budget_added_p50_ms": 0.2}
TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip
PROMPT = "hello gateway"


def engine_config(model_dir: str):
    from engine.config import EngineConfig

    return EngineConfig(model=f"dummy:{model_dir}", num_kv_blocks=256, max_model_len=256, max_loras=0)


def run_child(model_dir: str, database_url: str, port: int, spool: str, log_level: str, log_path: str,
              redis_url: str | None = None) -> None:
    """The server: the whole gateway on the tiny model, under uvicorn as ``tiergate serve`` runs it."""
    import uvicorn

    from billing.db import create_engine_for
    from billing.ledger import Ledger
    from engine.engine import Engine
    from gateway.app import create_app
    from gateway.logs import configure_logging
    from gateway.server import uvicorn_config
    from gateway.settings import Settings

    configure_logging(log_level, stream=open(log_path, "a", encoding="utf-8"))  # noqa: SIM115 (the process's life)
    settings = Settings(database_url=database_url, port=port, spool_path=spool, log_level=log_level,
                        redis_url=redis_url or None, redis_key_prefix=f"bench:{os.getpid()}")
    db = create_engine_for(database_url)
    app = create_app(settings, Engine(engine_config(model_dir)), db, Ledger(db, spool))
    uvicorn.Server(uvicorn_config(settings, app)).run()


def set_up(tmp: Path) -> tuple[str, str, str, str, str]:
    from datetime import datetime

    from billing.budgets import set_budget
    from billing.db import create_engine_for, upgrade
    from billing.keys import create_key
    from billing.prices import set_price
    from billing.tenants import create_tenant

    model_dir = tmp / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
    url = f"sqlite:///{tmp / 'bench.db'}"
    upgrade(url)
    db = create_engine_for(url)
    create_tenant(db, "bench", "premium", rpm=1_000_000, tpm=1_000_000_000, max_concurrent=1000)
    create_tenant(db, "flood", "standard", rpm=1, tpm=1_000_000, max_concurrent=1000)
    create_tenant(db, "budgeted", "premium", rpm=1_000_000, tpm=1_000_000_000, max_concurrent=1000)
    for unit, limit in (("tokens", 1e12), ("gpu_seconds", 1e9), ("usd", 1e9)):
        set_budget(db, "budgeted", unit, limit)
    set_price(db, "premium", 0.002, 0.5, 1.5, effective_from=datetime(2026, 1, 1), allow_past=True)
    return (str(model_dir), url, create_key(db, "bench")[1], create_key(db, "flood")[1],
            create_key(db, "budgeted")[1])


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the gateway process exited during startup")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


def direct_caller(engine) -> Callable[[str], float]:
    """A function that calls ``engine`` directly once (greedy, one token, the bench's prompt): its seconds."""
    from engine.request import EngineRequest, SamplingParams

    ids, params = engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=1, temperature=0)

    def call(request_id: str) -> float:
        t0 = time.perf_counter()
        engine.generate_batch_sync([EngineRequest(request_id, ids, params)])
        return time.perf_counter() - t0

    return call


def measure_latency(port: int, key: str, engine, n: int, client: str = "raw") -> tuple[list[float], list[float]]:
    """Seconds per request, HTTP and direct, alternating; both greedy, one token, same prompt."""
    body = json.dumps({"model": engine.model_name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    # One keep-alive connection, as an SDK client keeps.
    http_client = (RawClient if client == "raw" else HttpClientPost)(port, "/v1/completions", headers, body)
    call_direct = direct_caller(engine)
    via_http, direct = [], []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            status = http_client.post()
            via_http.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"HTTP path failed: {status}")
            direct.append(call_direct(f"direct-{i}"))
    finally:
        http_client.close()
    return via_http, direct


def measure_budget_overhead(port: int, plain_key: str, budgeted_key: str, model: str, n: int,
                            client: str = "raw") -> tuple[list[float], list[float]]:
    """Seconds per request of a tenant without budgets and of one with three, alternating on one server."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    kind = RawClient if client == "raw" else HttpClientPost
    clients = [kind(port, "/v1/completions", {"authorization": f"Bearer {key}", "content-type": "application/json"},
                    body) for key in (plain_key, budgeted_key)]
    seconds: list[list[float]] = [[], []]
    try:
        for _ in range(n):
            for i, c in enumerate(clients):
                t0 = time.perf_counter()
                status = c.post()
                seconds[i].append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"budget bench request failed: {status}")
    finally:
        for c in clients:
            c.close()
    return seconds[0], seconds[1]


def measure_gate(database_url: str, n: int, redis_url: str | None) -> list[float]:
    """Seconds per request of the budget gate alone: admit, then settle from a final record (three budgets)."""
    from billing.db import create_engine_for
    from billing.usage_record import UsageRecord
    from gateway.budget_gate import BudgetGate, make_budget_store

    async def run() -> list[float]:
        gate = BudgetGate(create_engine_for(database_url), make_budget_store(redis_url, f"bench-gate:{os.getpid()}"))
        seconds = []
        try:
            for i in range(n):
                now = time.time()
                record = UsageRecord(f"gate-{i}", "budgeted", "premium", None, "ok", now, now, prompt_tokens=3,
                                     completion_tokens=1, gpu_seconds=0.0005)
                t0 = time.perf_counter()
                await gate.admit(record.request_id, "budgeted", "premium", now, 3, 1)
                await gate.settle(record)
                seconds.append(time.perf_counter() - t0)
        finally:
            await gate.close()
        return seconds[min(50, n // 10):]  # the first ones load the periods from the ledger

    return asyncio.run(run())


def measure_direct(engine, n: int) -> list[float]:
    """Seconds per direct call, back to back: the engine with its caches warm."""
    call_direct = direct_caller(engine)
    return [call_direct(f"direct-back-to-back-{i}") for i in range(n)]


def measure_ledger_commit(database_url: str, spool: str, n: int) -> list[float]:
    """Seconds per durable ledger write on the same database, the way the server makes one per request."""
    from billing.db import create_engine_for
    from billing.ledger import Ledger
    from billing.usage_record import UsageRecord

    seconds = []
    with Ledger(create_engine_for(database_url), spool) as ledger:
        for i in range(n):
            now = time.time()
            records = [UsageRecord(f"bench-commit-{i}", "bench", "premium", None, "ok", now, now)]
            t0 = time.perf_counter()
            if not ledger.write_now(records):
                ledger.submit(records).result()
            seconds.append(time.perf_counter() - t0)
    return seconds


async def flood(port: int, key: str, model: str, seconds: float, connections: int) -> tuple[int, int, float]:
    """(429s, other responses, elapsed) from ``connections`` keep-alive connections sending back to back.

    A raw HTTP/1.1 client: httpx or the openai SDK would spend more CPU per request
    than the server does on a 429, and we would be measuring the client.
    """
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts = {"429": 0, "other": 0}
    stop_at = time.monotonic() + seconds

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head[9:12]
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            counts["429" if status == b"429" else "other"] += 1
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*[one_connection() for _ in range(connections)])
    return counts["429"], counts["other"], time.monotonic() - started


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--flood-seconds", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--client", choices=["raw", "http.client"], default="raw",
                   help="the HTTP client that times the gateway (see the module's docstring)")
    p.add_argument("--log-level", choices=["info", "warning"], default="info",
                   help="the server's; info (tiergate serve's default) writes an access-log line per request")
    p.add_argument("--redis-url", default="", help="hold rate limits and budgets in this Redis (default: in process)")
    p.add_argument("--out", default="bench/out/gateway_overhead.json")
    p.add_argument("--child", nargs=5, metavar=("MODEL_DIR", "DB_URL", "PORT", "SPOOL", "LOG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_child(*args.child[:2], int(args.child[2]), args.child[3], args.log_level, args.child[4], args.redis_url)
        return {}

    from engine.cpu_build import cpu_kernels_loaded
    from engine.engine import Engine

    cpu_kernels_loaded()  # a first run builds the CPU kernels here, not inside the server's readiness wait
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, url, bench_key, flood_key, budgeted_key = set_up(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.live.gateway_overhead", "--log-level", args.log_level, "--redis-url",
             args.redis_url, "--child", model_dir, url, str(port), str(tmp / "spool.jsonl"), str(tmp / "server.log")],
            cwd=paths.ROOT, env={**os.environ},
        )
        try:
            wait_ready(port, child)
            engine = Engine(engine_config(model_dir)).start()
            measure_latency(port, bench_key, engine, 30, args.client)  # warm up both paths
            via_http, direct = measure_latency(port, bench_key, engine, args.requests, args.client)
            direct_back_to_back = measure_direct(engine, min(args.requests, 300))
            model = engine.model_name
            engine.shutdown()
            measure_budget_overhead(port, bench_key, budgeted_key, model, 30, args.client)  # warm up
            no_budget, with_budgets = measure_budget_overhead(port, bench_key, budgeted_key, model, args.requests,
                                                              args.client)
            gate = measure_gate(url, args.requests, args.redis_url or None)
            commits = measure_ledger_commit(url, str(tmp / "bench-spool.jsonl"), min(args.requests, 200))
            rejected, other, elapsed = asyncio.run(
                flood(port, flood_key, engine.model_name, args.flood_seconds, args.connections)
            )
        finally:
            child.terminate()
            child.wait(timeout=30)
        server_log = tmp / "server.log"
        log_lines = len(server_log.read_text().splitlines()) if server_log.exists() else 0

    ms = lambda values, q: 1000 * percentile(values, q)  # noqa: E731
    result = {
        "requests": args.requests,
        "http_p50_ms": ms(via_http, 50), "http_p99_ms": ms(via_http, 99),
        "direct_p50_ms": ms(direct, 50), "direct_p99_ms": ms(direct, 99),
        "added_p50_ms": ms(via_http, 50) - ms(direct, 50),
        "added_p99_ms": ms(via_http, 99) - ms(direct, 99),
        "direct_back_to_back_p50_ms": ms(direct_back_to_back, 50),
        "client": args.client, "log_level": args.log_level, "server_log_lines": log_lines,
        "load_1min": os.getloadavg()[0],
        "ledger_commit_p50_ms": ms(commits, 50), "ledger_commit_p99_ms": ms(commits, 99),
        "rejections": rejected, "non_429_during_flood": other,
        "rejections_per_s": rejected / elapsed,
        "budget_store": "redis" if args.redis_url else "in process",
        "no_budget_p50_ms": ms(no_budget, 50), "three_budgets_p50_ms": ms(with_budgets, 50),
        "no_budget_p99_ms": ms(no_budget, 99), "three_budgets_p99_ms": ms(with_budgets, 99),
        "budget_added_p50_ms": ms(with_budgets, 50) - ms(no_budget, 50),
        "budget_gate_p50_ms": ms(gate, 50), "budget_gate_p99_ms": ms(gate, 99),
        "goals": GOALS,
    }  # fmt: skip
    print(f"gateway overhead ({args.requests} requests, 1 token each, tiny model, this CPU, "
          f"{args.client} client, server log level {args.log_level}: {log_lines} log lines, "
          f"load {result['load_1min']:.2f})")
    print(f"  HTTP   p50 {result['http_p50_ms']:.3f} ms  p99 {result['http_p99_ms']:.3f} ms")
    print(f"  direct p50 {result['direct_p50_ms']:.3f} ms  p99 {result['direct_p99_ms']:.3f} ms  "
          f"(back to back, not alternating: p50 {result['direct_back_to_back_p50_ms']:.3f} ms)")
    print(f"  added  p50 {result['added_p50_ms']:.3f} ms (goal < {GOALS['added_p50_ms']})  "
          f"p99 {result['added_p99_ms']:.3f} ms (goal < {GOALS['added_p99_ms']})")
    print(f"  of which the ledger row's durable commit (SQLite, before the last byte): "
          f"p50 {result['ledger_commit_p50_ms']:.3f} ms  p99 {result['ledger_commit_p99_ms']:.3f} ms")
    print(f"  429s: {result['rejections_per_s']:.0f}/s from one process (goal >= {GOALS['rejections_per_s']}), "
          f"{other} other responses")
    print(f"  budgets ({result['budget_store']}, {args.requests} requests each, alternating): no budget p50 "
          f"{result['no_budget_p50_ms']:.3f} ms p99 {result['no_budget_p99_ms']:.3f} ms; tokens + GPU-seconds + USD "
          f"budgets p50 {result['three_budgets_p50_ms']:.3f} ms p99 {result['three_budgets_p99_ms']:.3f} ms; added p50 "
          f"{result['budget_added_p50_ms']:.3f} ms (goal < {GOALS['budget_added_p50_ms']})")
    print(f"  the budget gate alone (admit + settle, three budgets, {result['budget_store']}): "
          f"p50 {result['budget_gate_p50_ms']:.3f} ms p99 {result['budget_gate_p99_ms']:.3f} ms")
    report.write_json(result, args.out)  # its summary is the lines printed above
    return result


if __name__ == "__main__":
    main()
