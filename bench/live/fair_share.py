"""Fair share through the real gateway: a light standard tenant's TTFT beside a flooding one, tiered vs fcfs.

Policies: ``tiered`` (fair share with express steps between a step's layers, the
default), ``tiered-step-end`` (fair share, express steps off:
``TIERGATE_EXPRESS_STEPS=0``) and ``fcfs``.

For each policy a `tiergate serve` (bundled model, this CPU, a throwaway
SQLite database), all up at once and measured in turns (``--rounds``, in the
order ABBA...), with two standard tenants: "flood" keeps 30
streams of long requests open (a new one as each ends) and "light" sends a
short request every ``--light-every`` seconds. The light tenant's TTFT is
measured alone first, then beside the flood after a warm-up; throughput is
the streamed output tokens (SSE text chunks) of both tenants over the flood
window, compared round by round. Both policies run with no
premium KV reserve (`TIERGATE_PREMIUM_KV_RESERVE=0`), so they have the same
pool for standard and the comparison is of ordering alone.

    .venv/bin/python -m bench.live.fair_share [--policies tiered,tiered-step-end,fcfs] [--flood-s 45] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import sys
import tempfile
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.common import machine, paths, report
from bench.common.stats import percentile
from bench.live.server import free_port, start_server, stop_server, tiergate_cli

PLOT = paths.OUT / "fair_share" / "fair_share_light_ttft.png"
PASSAGES = paths.PASSAGES.read_text().split("\n\n")
LIMITS = ["--rpm", "100000", "--tpm", "100000000", "--max-concurrent", "1000"]
WARM_UP_REQUESTS = 5
# The policies this bench can run: the server's --policy and its extra environment.
VARIANTS = {
    "tiered": ("tiered", {}),
    "tiered-step-end": ("tiered", {"TIERGATE_EXPRESS_STEPS": "0"}),  # fair share without express steps
    "fcfs": ("fcfs", {}),
}


def flood_prompt(n: int, chars: int) -> str:
    """A long prompt that shares no prefix with any other (the number comes first)."""
    text = f"Request {n}. " + " ".join(PASSAGES)
    return text[:chars]


def light_prompt(n: int) -> str:
    return f"Note {n}: summarise in one line. " + PASSAGES[n % len(PASSAGES)][:120]


@dataclass
class Streamed:
    """Text chunks (about one token each) received so far, by every stream."""

    chunks: int = 0
    refused: int = 0  # requests answered 429


@dataclass
class Light:
    """One light request as the client saw it; its ledger row adds the server's side."""

    request_id: str
    ttft_s: float


async def ttft(client: httpx.AsyncClient, url: str, key: str, prompt: str, max_tokens: int,
               streamed: Streamed) -> Light | None:
    """Seconds to the first streamed text of one completion, with its id; None if it failed."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first, request_id = None, ""
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:  # a 429: counted as not ok
            streamed.refused += 1
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            chunk = json.loads(data)
            request_id = request_id or chunk.get("id", "")
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                streamed.chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    return None if first is None else Light(request_id, first)


async def light_loop(client, url, key, every_s: float, duration_s: float, streamed: Streamed) -> list[asyncio.Task]:
    """Send for ``duration_s``; the requests' tasks (TTFT or None), still running."""
    tasks = []
    end = time.monotonic() + duration_s
    for n in itertools.count():
        if time.monotonic() >= end:
            return tasks
        tasks.append(asyncio.create_task(ttft(client, url, key, light_prompt(n), 8, streamed)))
        await asyncio.sleep(every_s)


async def flood_stream(client, url, key, ids, prompt_chars: int, max_tokens: int, stop: asyncio.Event,
                       streamed: Streamed) -> None:
    while not stop.is_set():
        try:
            if await ttft(client, url, key, flood_prompt(next(ids), prompt_chars), max_tokens, streamed) is None:
                await asyncio.sleep(0.5)  # refused: a real client backs off too
        except httpx.HTTPError:
            await asyncio.sleep(0.5)


async def measure(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict:
    timeout = httpx.Timeout(600, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=100)) as client:
        streamed = Streamed()
        for n in range(WARM_UP_REQUESTS):  # not measured: a fresh server's first steps try thread counts
            await ttft(client, url, keys["light"], light_prompt(10**6 + n), 8, streamed)
        alone = await asyncio.gather(*await light_loop(client, url, keys["light"], args.alone_every, args.alone_s,
                                                       streamed))
        stop = asyncio.Event()
        ids = itertools.count()
        flood = [asyncio.create_task(flood_stream(client, url, keys["flood"], ids, args.flood_prompt_chars,
                                                  args.flood_max_tokens, stop, streamed)) for _ in range(args.flood)]
        await asyncio.sleep(args.warmup_s)
        before, refused_before, started = streamed.chunks, streamed.refused, time.monotonic()
        work_before = await wasted_work(client, url)
        sent = await light_loop(client, url, keys["light"], args.light_every, args.flood_s, streamed)
        # Throughput over the sending window alone, the same length under every policy; counted as
        # the tokens arrive (the gateway's own counters move only when a request ends).
        after, elapsed = streamed.chunks, time.monotonic() - started
        work_after = await wasted_work(client, url)
        refused = streamed.refused - refused_before
        beside = await asyncio.gather(*sent)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return {"alone": alone, "flood": beside, "tokens_per_s": (after - before) / elapsed,
            "refused_in_window": refused,
            **{k: work_after[k] - work_before[k] for k in work_after},
            "flood_requests_started": next(ids)}


async def wasted_work(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Standard's preemptions and recomputed tokens so far, from /metrics: the work a policy throws
    away, which a shared machine's load does not blur as it does tokens per second."""
    text = (await client.get(url + "/metrics")).text
    found = {"preemptions": 0.0, "recomputed_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("tier") != "standard":
                continue
            if sample.name == "tiergate_preemptions_total":
                found["preemptions"] += sample.value
            elif sample.name == "tiergate_tokens_total" and sample.labels.get("kind") == "recompute":
                found["recomputed_tokens"] += sample.value
    return found


def server_ttfts(db: Path) -> dict[str, float]:
    """The light tenant's TTFT as the server saw it, by request id: from the handler's start to the
    engine's first token (the ledger's queued_at and first_token_at). Set beside the client's
    figure it tells the engine's wait from the time spent in HTTP, the event loops and the client."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT request_id, queued_at, first_token_at FROM usage_ledger "
                            "WHERE tenant = 'light' AND first_token_at IS NOT NULL").fetchall()
    return {request_id: (datetime.fromisoformat(first) - datetime.fromisoformat(queued)).total_seconds()
            for request_id, queued, first in rows}


def _summary(client: list[float], server: list[float]) -> dict:
    return {"ok": len(client), "ttft_p50_s": percentile(client, 50), "ttft_p99_s": percentile(client, 99),
            "server_ttft_p50_s": percentile(server, 50), "server_ttft_p99_s": percentile(server, 99),
            "ttfts": client, "server_ttfts": server}


def summarise(measured: dict, server: dict[str, float]) -> dict:
    """One measurement's light requests as client and server saw them."""
    out = dict(measured)
    for phase in ("alone", "flood"):
        lights = [light for light in measured[phase] if light is not None]
        out[phase] = {**_summary([light.ttft_s for light in lights],
                                 [server[light.request_id] for light in lights if light.request_id in server]),
                      "sent": len(measured[phase])}
    return out


def run(args: argparse.Namespace) -> dict:
    """Both servers up at once, measured in turns (ABBA...), so a shared machine's load falls on both alike."""
    policies = args.policies.split(",")
    host = machine.describe()
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="tiergate-fair-share-") as tmp:
        env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp}/tiergate.db",
               "TIERGATE_LOG_LEVEL": "warning", "TIERGATE_PREMIUM_KV_RESERVE": "0"}
        tiergate_cli(env, "db", "upgrade")
        keys = {}
        for name in ("flood", "light"):
            tiergate_cli(env, "tenants", "create", name, "--tier", "standard", *LIMITS)
            keys[name] = tiergate_cli(env, "keys", "create", name).splitlines()[-1]
        servers = {}
        try:
            for policy in policies:  # each its own copy of the database (same tenants and keys): no shared writer
                shutil.copy(f"{tmp}/tiergate.db", f"{tmp}/{policy}.db")
                server_policy, extra_env = VARIANTS[policy]
                own = {**env, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp}/{policy}.db",
                       "TIERGATE_SPOOL_PATH": f"{tmp}/{policy}-spool.jsonl", **extra_env}
                port = free_port()
                servers[policy] = (start_server(own, server_policy, port, premium_slo_s=2.0), port)
            for i in range(args.rounds):
                rounds.append({})
                for policy in policies if i % 2 == 0 else policies[::-1]:
                    print(f"fair_share_gateway: round {i + 1}, {policy}", file=sys.stderr, flush=True)
                    r = asyncio.run(measure(f"http://127.0.0.1:{servers[policy][1]}", keys, args))
                    rounds[-1][policy] = r
                    print(f"fair_share_gateway: {policy}: {json.dumps(summarise(r, {}))}",
                          file=sys.stderr, flush=True)
        finally:
            for server, _ in servers.values():
                stop_server(server)
        server = {policy: server_ttfts(Path(f"{tmp}/{policy}.db")) for policy in policies}
        rounds = [{policy: summarise(r, server[policy]) for policy, r in one.items()} for one in rounds]
    by_policy = {policy: _merge([r[policy] for r in rounds]) for policy in policies}
    result = {"machine": host, "settings": {k: v for k, v in vars(args).items() if k != "json"}, "policies": by_policy,
              "rounds": rounds, "goals": goals(by_policy, rounds)}
    result["plots"] = [str(plot(by_policy).relative_to(paths.ROOT))]
    return result


def _merge(measured: list[dict]) -> dict:
    """One policy's rounds together: TTFTs pooled, counts added, throughput averaged."""
    merged = {}
    for phase in ("alone", "flood"):
        merged[phase] = _summary([t for m in measured for t in m[phase]["ttfts"]],
                                 [t for m in measured for t in m[phase]["server_ttfts"]])
        merged[phase]["sent"] = sum(m[phase]["sent"] for m in measured)
    merged["tokens_per_s"] = sum(m["tokens_per_s"] for m in measured) / len(measured)
    for key in ("refused_in_window", "preemptions", "recomputed_tokens"):
        merged[key] = sum(m[key] for m in measured)
    for side in ("", "server_"):
        a, f = merged["alone"][f"{side}ttft_p99_s"], merged["flood"][f"{side}ttft_p99_s"]
        # None: no light request was served beside the flood (all refused with 429).
        merged[f"{side}p99_ratio"] = f / a if a is not None and f is not None else None
    return merged


def goals(by_policy: dict, rounds: list[dict]) -> list[dict]:
    if not {"tiered", "fcfs"} <= by_policy.keys():
        return []
    t, f = by_policy["tiered"], by_policy["fcfs"]
    # Each round's ratio is of two runs minutes apart at most; the median of them resists one noisy round.
    throughput = float(np.median([r["tiered"]["tokens_per_s"] / max(r["fcfs"]["tokens_per_s"], 1e-9)
                                  for r in rounds]))
    inf = float("inf")  # a ratio with nothing served beside the flood
    t_ratio, f_ratio = t["p99_ratio"] or inf, f["p99_ratio"] or inf
    worse = f_ratio / t_ratio if t_ratio != inf else 0.0
    return [
        {"goal": "light TTFT p99 beside the flood within 2x of alone (tiered)", "value": t_ratio,
         "met": t_ratio <= 2},
        {"goal": "fcfs far worse (its p99 ratio over tiered's, at least 5; inf: none served)", "value": worse,
         "met": worse >= 5},
        # The goal guards against fair share costing throughput: serving more than fcfs (which
        # preempts and recomputes more beside a flood) loses nothing.
        {"goal": "throughput beside the flood at most 5% below fcfs (tiered / fcfs, median over rounds)",
         "value": throughput,
         "met": throughput >= 0.95},
    ]


def plot(by_policy: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, (policy, r) in enumerate(by_policy.items()):
        for phase, style in (("alone", ":"), ("flood", "-")):
            values = sorted(r[phase]["ttfts"])
            if values:
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, style, color=f"C{i}", where="post", label=f"{policy}, {phase}")
    ax.set_xscale("log")
    ax.set_xlabel("light tenant's TTFT (s, log scale)")
    ax.set_ylabel("share of its requests")
    ax.set_title("Light standard tenant beside a 30-stream flood, by policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return PLOT


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _ratio(v) -> str:
    return "none served" if v is None else f"{v:.1f}x"


def render_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        report.measured(result),
        "",
        f"`tiergate serve`, bundled model on this CPU, no premium KV reserve. Flood: {s['flood']} streams, "
        f"prompts of {s['flood_prompt_chars']} characters, {s['flood_max_tokens']} output tokens; light: one "
        f"request every {s['light_every']:g} s, about 40 prompt tokens, 8 output tokens; {s['alone_s']:g} s alone "
        f"(a request every {s.get('alone_every', s['light_every']):g} s), "
        f"then {s['warmup_s']:g} s of flood warm-up and {s['flood_s']:g} s measured beside it; "
        f"{s.get('rounds', 1)} round(s) per policy, the servers up together and measured in turns.",
        "",
        "| policy | light TTFT p50 / p99 alone (s) | light TTFT p50 / p99 beside the flood (s) | p99 ratio "
        "| server side: p99 alone / beside (s), ratio "
        "| light ok / sent | 429s in the window (both tenants) | output tokens/s beside the flood "
        "| preemptions / recomputed tokens in the window |",
        "|---|---|---|---:|---|---|---:|---:|---:|",
    ]
    for policy, r in result["policies"].items():
        a, f = r["alone"], r["flood"]
        lines.append(f"| {policy} | {_fmt(a['ttft_p50_s'])} / {_fmt(a['ttft_p99_s'])} | {_fmt(f['ttft_p50_s'])} / "
                     f"{_fmt(f['ttft_p99_s'])} | {_ratio(r['p99_ratio'])} | {_fmt(a['server_ttft_p99_s'])} / "
                     f"{_fmt(f['server_ttft_p99_s'])}, {_ratio(r['server_p99_ratio'])} | {f['ok']} / {f['sent']} "
                     f"| {r.get('refused_in_window', '-')} | {r['tokens_per_s']:.1f} "
                     f"| {r['preemptions']:.0f} / {r['recomputed_tokens']:.0f} |")
    lines += ["", *[f"- [{'MET' if g['met'] else 'MISSED'}] {g['goal']}: {g['value']:.3g}" for g in result["goals"]]]
    lines += ["", "The server side is from the ledger: the handler's start to the engine's first token. "
              "The plot: the light tenant's TTFT distribution per policy as its client saw it, alone (dotted) "
              "and beside the flood."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.live.fair_share", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="tiered,fcfs")
    p.add_argument("--flood", type=int, default=30, help="concurrent flood streams")
    p.add_argument("--flood-prompt-chars", type=int, default=1000, help="about 4 characters a token")
    p.add_argument("--flood-max-tokens", type=int, default=128)
    p.add_argument("--light-every", type=float, default=1.5, help="seconds between light requests")
    p.add_argument("--alone-s", type=float, default=15.0)
    p.add_argument("--alone-every", type=float, default=0.5,
                   help="seconds between light requests while it is alone (more samples for its p99)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="the flood reaches its steady state first")
    p.add_argument("--flood-s", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=1, help="turns per policy, interleaved ABBA")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if min(args.flood, args.flood_prompt_chars, args.flood_max_tokens, args.rounds) < 1 or min(
            args.light_every, args.alone_every, args.alone_s, args.flood_s) <= 0 or args.warmup_s < 0:
        p.error("counts and durations must be positive")
    unknown = set(args.policies.split(",")) - VARIANTS.keys()
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args)
    except RuntimeError as exc:
        print(f"fair_share_gateway: {exc}", file=sys.stderr)
        return 1
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
