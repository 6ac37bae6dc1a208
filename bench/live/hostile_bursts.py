"""What a burst of requests costs a neighbour's first token, by what the burst carries (issue #31, grammar_flood).

The hostile bench's grammar_flood sends 45 requests at once, each a choice of 1000
random strings (about 62 KB); its neighbour's first request goes out as the burst
starts. This bench asks which part of that burst the neighbour pays for: one
`tiergate serve --demo` (as bench/live/hostile.py starts it), and for each variant,
in turn and repeated, one neighbour request (from a process of its own) sent as a
burst of 45 requests starts:

- ``none``: no burst, the neighbour's first token alone;
- ``grammar_flood``: the hostile bench's own bodies (a fresh set each time, so no grammar is cached);
- ``refused_62kb``: bodies of the same size, no grammar, refused with a 400 after the key and the body;
- ``unauthenticated_62kb``: the same bodies with a key that does not exist (401 before any body is read).

It prints the neighbour's TTFT per variant (median and largest, and the median's ratio to ``none``'s) and the
CPU the bench's own client spent sending each burst, which shares the server's cores on a one-box bench.

    .venv/bin/python -m bench.live.hostile_bursts [--reps 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter

import httpx

from bench.common import machine, report
from bench.live.hostile import (ATTACKER_LIMITS, NEIGHBOUR_LIMITS, attack_request, server_env, standard_tenants,
                                start_demo_server)
from bench.live.hostile_attacks import MODEL, attacks
from bench.live.hostile_neighbour import NeighbourProcess, neighbour_request
from bench.live.server import free_port, stop_server

VARIANTS = ("none", "grammar_flood", "refused_62kb", "unauthenticated_62kb")
BURST = 45
PAD_CHARS = 62_000  # a grammar_flood body's size
NO_SUCH_KEY = "sk-tiergate-no-such-key"


def burst(variant: str, rep: int) -> list[tuple[str, dict]]:
    """The (path, body) requests of one burst; ``rep`` picks grammar_flood's round, so its grammars are new."""
    if variant == "none":
        return []
    if variant == "grammar_flood":
        return next(a.bodies for a in attacks(1000 + rep) if a.name == "grammar_flood")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": -1,
            "user": "x" * PAD_CHARS}
    return [("/v1/chat/completions", body)] * BURST


async def one_burst(client: httpx.AsyncClient, url: str, keys: dict[str, str], variant: str, rep: int,
                    first_n: int) -> dict:
    """The neighbour's one request, sent as the burst starts: its TTFT, and the client's CPU for the burst."""
    bodies = burst(variant, rep)
    key = NO_SUCH_KEY if variant == "unauthenticated_62kb" else keys["attacker"]
    # The neighbour's window outlasts the burst, so it sends exactly one request.
    neighbour = await asyncio.to_thread(NeighbourProcess, url, keys["neighbour"], 2.5, first_n)
    cpu_before = time.process_time()
    outcomes = await asyncio.gather(*(attack_request(client, url, key, path, body) for path, body in bodies))
    client_cpu_s = time.process_time() - cpu_before
    await asyncio.sleep(2.0)
    sample = (await asyncio.to_thread(neighbour.stop))[0]
    return {"ttft_s": sample.ttft_s, "neighbour_status": sample.status, "client_cpu_s": client_cpu_s,
            "statuses": dict(Counter(str(o["status"]) for o in outcomes))}


async def measure(url: str, keys: dict[str, str], reps: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    n = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10),
                                 limits=httpx.Limits(max_connections=200)) as client:
        for _ in range(5):  # not measured: a fresh server's first steps try thread counts
            await neighbour_request(client, url, keys["neighbour"], n)
            n += 1
        for rep in range(reps):
            for variant in VARIANTS:  # interleaved, so the machine's drift weighs on every variant alike
                runs[variant].append(await one_burst(client, url, keys, variant, rep, n))
                n += 1
                print(f"hostile_bursts: {variant} {rep + 1}/{reps}: TTFT {runs[variant][-1]['ttft_s']}",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(2.0)
    return runs


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    ttfts = {variant: [r["ttft_s"] for r in results if r["ttft_s"] is not None] for variant, results in runs.items()}
    medians = {variant: statistics.median(t) if t else None for variant, t in ttfts.items()}
    base = medians["none"]
    out = {}
    for variant, results in runs.items():
        median = medians[variant]
        statuses = sum((Counter(r["statuses"]) for r in results), Counter())
        out[variant] = {"ttft_s": ttfts[variant], "ttft_median_s": median,
                        "ttft_max_s": max(ttfts[variant], default=None),
                        "ratio_to_none": median / base if median is not None and base else None,
                        "client_cpu_ms_median": 1000 * statistics.median(r["client_cpu_s"] for r in results),
                        "statuses": dict(statuses),
                        "neighbour_errors": sum(r["neighbour_status"] != 200 for r in results)}
    return out


def run(args: argparse.Namespace) -> dict:
    host = machine.describe()
    with tempfile.TemporaryDirectory(prefix="tiergate-bursts-") as tmp:
        _, env = server_env(tmp)
        keys = standard_tenants(env, [("neighbour", NEIGHBOUR_LIMITS), ("attacker", ATTACKER_LIMITS)])
        port = free_port()
        server = start_demo_server(env, port)
        try:
            runs = asyncio.run(measure(f"http://127.0.0.1:{port}", keys, args.reps))
        finally:
            stop_server(server)
    return {"machine": host, "settings": {"reps": args.reps, "burst": BURST}, "variants": summarise(runs)}


def render_markdown(result: dict) -> str:
    lines = [report.measured(result), "",
             f"One neighbour request sent as a burst of {BURST} requests starts, {result['settings']['reps']} times "
             "per variant, interleaved (`tiergate serve --demo`, default settings).", "",
             "| burst | neighbour TTFT median (ms) | largest (ms) | median / none's | each TTFT (ms) "
             "| bench client CPU a burst (ms) | burst answers |",
             "|---|---:|---:|---:|---|---:|---|"]
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    for variant, v in result["variants"].items():
        ratio = "-" if v["ratio_to_none"] is None else f"{v['ratio_to_none']:.2f}x"
        each = ", ".join(ms(t) for t in sorted(v["ttft_s"]))
        answers = ", ".join(f"{k}: {n}" for k, n in sorted(v["statuses"].items())) or "-"
        lines.append(f"| {variant} | {ms(v['ttft_median_s'])} | {ms(v['ttft_max_s'])} | {ratio} | {each} | "
                     f"{v['client_cpu_ms_median']:.1f} | {answers} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live.hostile_bursts", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.reps < 1:
        p.error("--reps must be positive")
    try:
        result = run(args)
    except RuntimeError as exc:  # the server did not start
        sys.exit(f"hostile_bursts: {exc}")
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
