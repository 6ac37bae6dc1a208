"""Hostile tenants (issue #31): a neighbour's stream beside each attack, one attack at a time.

One `tiergate serve --demo` (the bundled model, `make serve`'s defaults, a throwaway
SQLite database) with the demo tenants plus standard tenants of the bench's own: the
neighbour, which streams a short completion every ``--neighbour-every-s`` from a process
of its own (another client, as a real neighbour is: ``NeighbourProcess``), and one attacker
per attack (limits: 8 concurrent). The neighbour runs alone first and again after the
last attack (its baseline, both pooled: the machine's drift weighs on both sides), and
beside each attack of bench/live/hostile_attacks.py in turn, for at least ``--window-s``
(the attack bounded by ``--attack-timeout-s``): four requests a second make a window's p99
the tail of some 60 first tokens, not the worst of eight. Per attack: the neighbour's TTFT p99 and
largest inter-token gap against its baseline (goal: within 2x), the attack's answers by
status, 5xx (goal: none), its ledger rows against its requests (goal: one each), and,
where the attack asks, that no tool call carries arguments that are not JSON. The
server's RSS is sampled throughout (goal: under 1.5 GB at the end); ``--rounds`` repeats
the attacks, each round's RSS reported, to show growth.

    .venv/bin/python -m bench.live.hostile [--rounds 1] [--only grammar_flood,tools_900kb] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import machine, report
from bench.live.hostile_attacks import Attack, attacks
from bench.live.hostile_neighbour import NeighbourProcess, Sample, baseline_stats, neighbour_request, neighbour_stats
from bench.live.server import free_port, start_server, stop_server, tiergate_cli
from gateway.tool_calls import is_json

RSS_GOAL_MB = 1536
HEAVY_NEIGHBOUR_SHARE = 0.5  # of the engine's time, alone
RATIO_GOAL = 2.0
NEIGHBOUR_LIMITS = ["--rpm", "100000", "--tpm", "100000000", "--max-concurrent", "100"]
ATTACKER_LIMITS = ["--rpm", "100000", "--tpm", "100000000", "--max-concurrent", "8"]


async def attack_request(client, url: str, key: str, path: str, body: dict) -> dict:
    """One attack request: its status, and whether a 200 carried a tool call whose arguments are not JSON."""
    headers = {"authorization": f"Bearer {key}"}
    calls: list[dict] = []
    try:
        if body.get("stream"):
            async with client.stream("POST", url + path, json=body, headers=headers) as response:
                status = response.status_code
                async for line in response.aiter_lines():
                    if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                        chunk = json.loads(data)
                        if "error" in chunk:
                            status = f"stream error {chunk['error'].get('code')}"
                        for choice in chunk.get("choices") or ():
                            calls += (choice.get("delta") or {}).get("tool_calls") or []
        else:
            response = await client.post(url + path, json=body, headers=headers)
            status = response.status_code
            if status == 200:
                for choice in response.json().get("choices") or ():
                    calls += (choice.get("message") or {}).get("tool_calls") or []
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "bad_tool_calls": 0}
    return {"status": status, "bad_tool_calls": sum(not is_json(c["function"].get("arguments", "")) for c in calls
                                                    if "function" in c)}


async def run_attack(client, url: str, key: str, attack: Attack, timeout_s: float) -> list[dict]:
    """The attack's requests, ``concurrency`` at a time, for at most ``timeout_s``; those never sent are left out."""
    gate = asyncio.Semaphore(attack.concurrency)
    sent: set[int] = set()

    async def one(i: int, path: str, body: dict) -> dict:
        async with gate:
            sent.add(i)
            return await attack_request(client, url, key, path, body)

    tasks = [asyncio.create_task(one(i, path, body)) for i, (path, body) in enumerate(attack.bodies)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else {"status": "bench timeout", "bad_tool_calls": 0}
            for i, t in enumerate(tasks) if i in sent]


class RssSampler(threading.Thread):
    """The server's resident set size (MB), every ``every_s``."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.samples: list[float] = []
        self.done = threading.Event()

    def now_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                self.samples.append(self.now_mb())
            except OSError:
                return


def start_demo_server(env: dict, port: int) -> subprocess.Popen:
    """`tiergate serve --demo`, as `make serve` runs it (the tiered policy, its default), on ``port``."""
    return start_server(env, "tiered", port, premium_slo_s=0.5, extra_args=("--demo",))


def ledger_rows(db: Path, tenant: str) -> tuple[int, int, int]:
    """(rows, closed rows, distinct request ids) of a tenant."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*), sum(status != 'open'), count(DISTINCT request_id) FROM usage_ledger "
                            "WHERE tenant = ?", (tenant,)).fetchone()


def engine_seconds(db: Path, tenant: str) -> float:
    """The engine seconds billed to a tenant so far (its ledger rows' GPU-seconds)."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT coalesce(sum(gpu_seconds), 0) FROM usage_ledger WHERE tenant = ?",
                            (tenant,)).fetchone()[0]


def wait_for_rows(db: Path, tenant: str, expected: int, timeout_s: float) -> tuple[int, int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = ledger_rows(db, tenant)
        if (rows[1] or 0) >= expected or time.monotonic() > deadline:
            return rows[0], rows[1] or 0, rows[2]
        time.sleep(0.5)


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def phase_report(name: str, baseline: dict, neighbour: dict, outcomes: list[dict], rows: tuple[int, int, int],
                 attack_s: float | None = None) -> dict:
    """One attack's numbers against the baseline, and its goals; ``attack_s``: how long its requests took."""
    statuses = Counter(str(o["status"]) for o in outcomes)
    five_xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    five_xx += sum(int(s) >= 500 for s in neighbour["errors"] if s.isdigit())
    ttft_ratio = _ratio(neighbour["ttft_p99_s"], baseline["ttft_p99_s"])
    gap_ratio = _ratio(neighbour["max_gap_s"], baseline["max_gap_s"])
    total, closed, distinct = rows
    return {"attack": name, "attack_s": attack_s, "sent": len(outcomes), "statuses": dict(statuses), "five_xx": five_xx,
            "bad_tool_calls": sum(o["bad_tool_calls"] for o in outcomes), "rows": total, "closed_rows": closed,
            "distinct_rows": distinct, "neighbour": neighbour, "ttft_p99_ratio": ttft_ratio, "max_gap_ratio": gap_ratio,
            "met": {"neighbour_ttft_p99_within_2x": ttft_ratio is not None and ttft_ratio <= RATIO_GOAL,
                    "neighbour_max_gap_within_2x": gap_ratio is not None and gap_ratio <= RATIO_GOAL,
                    "no_5xx": five_xx == 0, "one_row_per_request": total == closed == distinct == len(outcomes),
                    "tool_calls_json": sum(o["bad_tool_calls"] for o in outcomes) == 0}}


async def measure(url: str, keys: dict[str, str], db: Path, args, rss: RssSampler) -> dict:
    timeout = httpx.Timeout(args.attack_timeout_s + 30, connect=10)
    sent = 0  # the neighbour's requests, each with a prompt of its own number
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=200)) as client:
        for _ in range(3):  # not measured: a fresh server's first steps try thread counts
            await neighbour_request(client, url, keys["neighbour"], sent)
            sent += 1
        billed_before = await asyncio.to_thread(engine_seconds, db, "neighbour")
        alone_before = await _neighbour_alone(url, keys["neighbour"], args, sent)
        sent += len(alone_before)
        # Its share of the engine alone: past half, fair share lets any other tenant slow it, whatever it sends.
        await asyncio.to_thread(wait_for_rows, db, "neighbour", sent, 30)
        neighbour_share = (await asyncio.to_thread(engine_seconds, db, "neighbour") - billed_before) / args.baseline_s
        rss_start = rss.now_mb()
        rounds = []
        for round_no in range(args.rounds):
            phases = []
            for attack in attacks(round_no):
                if args.only and attack.name not in args.only:
                    continue
                print(f"hostile: round {round_no + 1}, {attack.name}", file=sys.stderr, flush=True)
                neighbour = await asyncio.to_thread(NeighbourProcess, url, keys["neighbour"],
                                                    args.neighbour_every_s, sent)
                started = time.monotonic()
                outcomes = await run_attack(client, url, keys[f"atk-{attack.name}"], attack, args.attack_timeout_s)
                attack_s = time.monotonic() - started
                await asyncio.sleep(max(0.0, args.window_s - (time.monotonic() - started)))
                samples = await asyncio.to_thread(neighbour.stop)
                sent += len(samples)
                neighbour = neighbour_stats(samples)
                before = sum(len(m["outcomes"]) for r in rounds for m in r["phases"] if m["name"] == attack.name)
                rows = await asyncio.to_thread(wait_for_rows, db, f"atk-{attack.name}", before + len(outcomes), 30)
                rows = (rows[0] - before, rows[1] - before, rows[2] - before)
                # Reported against the baseline once its second window, after the last attack, is in.
                phases.append({"name": attack.name, "neighbour": neighbour, "outcomes": outcomes, "rows": rows,
                               "attack_s": attack_s})
                print(f"hostile: answers {dict(Counter(str(o['status']) for o in outcomes))}, neighbour TTFT p99 "
                      f"{_fmt(neighbour['ttft_p99_s'])} s", file=sys.stderr, flush=True)
            rounds.append({"phases": phases, "rss_mb": rss.now_mb()})
        alone_after = await _neighbour_alone(url, keys["neighbour"], args, sent)
        sent += len(alone_after)
        await asyncio.sleep(args.settle_s)
    baseline = baseline_stats(alone_before, alone_after)
    rounds = [{"phases": [phase_report(baseline=baseline, **m) for m in r["phases"]], "rss_mb": r["rss_mb"]}
              for r in rounds]
    baseline["engine_share"] = neighbour_share
    return {"baseline": baseline, "rounds": rounds, "rss_start_mb": rss_start, "neighbour_sent": sent}


async def _neighbour_alone(url: str, key: str, args, first_n: int) -> list[Sample]:
    """The neighbour with no attack beside it, for ``args.baseline_s``."""
    neighbour = await asyncio.to_thread(NeighbourProcess, url, key, args.neighbour_every_s, first_n)
    await asyncio.sleep(args.baseline_s)
    return await asyncio.to_thread(neighbour.stop)


def summarise(measured: dict, rss_samples: list[float], rss_end_mb: float, neighbour_rows: int) -> dict:
    """The goals over every attack of every round."""
    phases = [p for r in measured["rounds"] for p in r["phases"]]
    goals = [{"goal": f"{name.replace('_', ' ')} for every attack", "met": all(p["met"][name] for p in phases),
              "missed_by": [p["attack"] for p in phases if not p["met"][name]]}
             for name in ("neighbour_ttft_p99_within_2x", "neighbour_max_gap_within_2x", "no_5xx",
                          "one_row_per_request", "tool_calls_json")]
    goals.append({"goal": f"server RSS under {RSS_GOAL_MB} MB at the end", "met": rss_end_mb < RSS_GOAL_MB,
                  "missed_by": [] if rss_end_mb < RSS_GOAL_MB else [f"{rss_end_mb:.0f} MB"]})
    goals.append({"goal": "one ledger row per neighbour request", "met": neighbour_rows == measured["neighbour_sent"],
                  "missed_by": [] if neighbour_rows == measured["neighbour_sent"]
                  else [f"{neighbour_rows} rows for {measured['neighbour_sent']} requests"]})
    return {**measured, "rss_peak_mb": max(rss_samples, default=None), "rss_end_mb": rss_end_mb,
            "neighbour_rows": neighbour_rows, "goals": goals}


def server_env(tmp: str) -> tuple[Path, dict]:
    """A throwaway SQLite database in ``tmp``, migrated, and the environment of a server on it."""
    db = Path(tmp) / "tiergate.db"
    env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{db}", "TIERGATE_LOG_LEVEL": "error",
           "TIERGATE_SPOOL_PATH": f"{tmp}/spool.jsonl"}
    tiergate_cli(env, "db", "upgrade")
    return db, env


def standard_tenants(env: dict, limits: list[tuple[str, list[str]]]) -> dict[str, str]:
    """Standard tenants of these names and limits flags; their keys by name."""
    keys = {}
    for name, flags in limits:
        tiergate_cli(env, "tenants", "create", name, "--tier", "standard", *flags)
        keys[name] = tiergate_cli(env, "keys", "create", name).splitlines()[-1]
    return keys


def run(args: argparse.Namespace) -> dict:
    host = machine.describe()
    with tempfile.TemporaryDirectory(prefix="tiergate-hostile-") as tmp:
        db, env = server_env(tmp)
        keys = standard_tenants(env, [("neighbour", NEIGHBOUR_LIMITS)]
                                + [(f"atk-{a.name}", ATTACKER_LIMITS) for a in attacks()])
        port = free_port()
        server = start_demo_server(env, port)
        rss = RssSampler(server.pid)
        rss.start()
        try:
            measured = asyncio.run(measure(f"http://127.0.0.1:{port}", keys, db, args, rss))
            rss_end = rss.now_mb()
        finally:
            rss.done.set()
            stop_server(server)
        neighbour_rows = ledger_rows(db, "neighbour")[0]
    result = summarise(measured, rss.samples, rss_end, neighbour_rows)
    return {"machine": host, "settings": {k: v for k, v in vars(args).items() if k != "json"}, **result}


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render_markdown(result: dict) -> str:
    s, b = result["settings"], result["baseline"]
    lines = [report.measured(result), "",
             f"`tiergate serve --demo` (bundled model, default settings); the neighbour (a standard tenant) streams "
             f"a 16-token completion every {s['neighbour_every_s']:g} s: alone for {s['baseline_s']:g} s before the "
             f"attacks and again after them (pooled: TTFT p50 / p99 {_fmt(b['ttft_p50_s'])} / "
             f"{_fmt(b['ttft_p99_s'])} s, largest inter-token gap {_fmt(b['max_gap_s'])} s, {b['served']} requests, "
             f"{b['engine_share']:.0%} of the engine's time before the attacks; "
             f"TTFT p99 before / after {_fmt(b['before']['ttft_p99_s'])} / {_fmt(b['after']['ttft_p99_s'])} s), then "
             f"beside each attack (at most {s['attack_timeout_s']:g} s, the neighbour sending for at least "
             f"{s['window_s']:g} s); {s['rounds']} round(s).", ""]
    if b["engine_share"] > HEAVY_NEIGHBOUR_SHARE:
        lines += [f"The neighbour alone took over {HEAVY_NEIGHBOUR_SHARE:.0%} of the engine on this machine: beside an "
                  "attack, fair share gives the other tenant its half, so what is measured is overload, not isolation "
                  "(a slower `--neighbour-every-s` makes it the light tenant the goals are about).", ""]
    lines += [
             "| round | attack | sent, seconds | answers | 5xx | rows / closed | neighbour TTFT p99 (s), ratio (max) "
             "| neighbour largest gap (s), ratio | neighbour served / sent |",
             "|---:|---|---:|---|---:|---|---|---|---|"]
    for i, r in enumerate(result["rounds"], start=1):
        for p in r["phases"]:
            n = p["neighbour"]
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(p["statuses"].items()))
            lines.append(f"| {i} | {p['attack']} | {p['sent']}, {_fmt(p['attack_s'], 1)} | {answers} | "
                         f"{p['five_xx']} | {p['rows']} / {p['closed_rows']} | {_fmt(n['ttft_p99_s'])}, "
                         f"{_fmt(p['ttft_p99_ratio'], 1)}x ({_fmt(n['ttft_max_s'])}) | "
                         f"{_fmt(n['max_gap_s'])}, {_fmt(p['max_gap_ratio'], 1)}x | {n['served']} / {n['sent']} |")
    rss = ", ".join(f"{r['rss_mb']:.0f}" for r in result["rounds"])
    lines += ["", f"Server RSS: {result['rss_start_mb']:.0f} MB after the baseline, {rss} MB after each round, "
              f"{_fmt(result['rss_peak_mb'], 0)} MB at its peak, {result['rss_end_mb']:.0f} MB at the end.", ""]
    lines += [f"- [{'MET' if g['met'] else 'MISSED'}] {g['goal']}"
              + (f" (missed: {', '.join(g['missed_by'])})" if g["missed_by"] else "") for g in result["goals"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.live.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-s", type=float, default=20.0, help="the neighbour alone before and after the attacks")
    p.add_argument("--window-s", type=float, default=15.0, help="the neighbour sends at least this long per attack")
    p.add_argument("--neighbour-every-s", type=float, default=0.25, help="the neighbour starts a request this often")
    p.add_argument("--attack-timeout-s", type=float, default=90.0, help="an attack's requests are given up after")
    p.add_argument("--settle-s", type=float, default=5.0, help="idle before the last RSS reading")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", type=lambda v: set(v.split(",")), default=None, help="attack names, comma separated")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    durations = (args.baseline_s, args.window_s, args.attack_timeout_s, args.neighbour_every_s)
    if min(durations) <= 0 or args.rounds < 1 or args.settle_s < 0:
        p.error("durations and rounds must be positive")
    unknown = (args.only or set()) - {a.name for a in attacks()}
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args)
    except RuntimeError as exc:  # the server did not start
        sys.exit(f"hostile: {exc}")
    report.finish(result, args.json, render_markdown, default=sorted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
