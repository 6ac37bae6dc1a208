"""SLO sweep through the real gateway: `tiergate serve` under tiered and fcfs, the same open-loop load.

For each policy a fresh server (bundled model, this CPU, a throwaway SQLite
database with one premium and two standard tenants) takes Poisson load at each
rate from bench/load/loadgen.py; results per tier and policy go to JSON and to plots
of latency and goodput against offered load, one line per tier and policy.

SLOs are scaled to this CPU. On the GPU settings (bench/sim/slo.py's H100
coefficients) the premium 0.5 s SLO is about 13x the unloaded TTFT of the mean
request (6 ms + 830 tokens x 40 us = 39 ms). Here the engine's fitted step cost
gives an unloaded TTFT of about 48 ms + 70 tokens x 1.6 ms = 0.16 s for the
sweep's mean prompt, so premium gets 13x that, 2 s, and standard's yardstick
stays ten times premium's, 20 s. Outputs ignore EOS so both policies do the
same work. Each tier's p99 inter-token gap (between two streamed chunks, as the
client sees them) is reported beside its TTFT; bench/sim/long_prompts.py and
bench/offline/long_prompts.py put long prompts beside premium streams.

    .venv/bin/python -m bench.live.slo [--rates 1,2,4] [--requests 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

from bench.common import model_files, paths, report
from bench.live.server import free_port, set_up_tenants, start_server, stop_server
from bench.load.aggregate import Slo
from bench.load.loadgen import LoadSettings, run_sweep
from bench.load.plots import plot_sweep

PLOTS_DIR = paths.OUT / "slo_sweep"


def _without_rows(point: dict) -> dict:
    return {k: v for k, v in point.items() if k != "requests"}


def run(args: argparse.Namespace) -> dict:
    rates = [float(r) for r in args.rates.split(",")]
    slos = {"premium": Slo(ttft_s=args.premium_ttft_slo), "standard": Slo(ttft_s=args.standard_ttft_slo)}
    by_policy: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tiergate-slo-sweep-") as tmp:
        env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp}/tiergate.db",
               "TIERGATE_SPOOL_PATH": f"{tmp}/spool.jsonl", "TIERGATE_LOG_LEVEL": "warning"}
        tenants = set_up_tenants(env)
        for policy in args.policies.split(","):
            port = free_port()
            print(f"slo_sweep: {policy} on port {port}", file=sys.stderr, flush=True)
            server = start_server(env, policy, port, args.premium_ttft_slo)
            try:
                settings = LoadSettings(
                    base_url=f"http://127.0.0.1:{port}", tenants=tenants,
                    tier_share={"premium": args.premium_share, "standard": 1 - args.premium_share},
                    slos=slos, num_requests=args.requests, prompt_len_range=(20, args.max_prompt),
                    output_len_range=(16, args.max_output), tokenizer_dir=model_files.hf_dir(), seed=args.seed,
                    ignore_eos=True,
                )
                by_policy[policy] = [_without_rows(p) for p in asyncio.run(run_sweep(settings, rates))]
            finally:
                stop_server(server)
    merged = []
    for i, rate in enumerate(rates):
        tiers = {f"{tier} ({policy})": stats for policy, points in by_policy.items()
                 for tier, stats in points[i]["tiers"].items()}
        merged.append({"offered": rate, "tiers": tiers})
    plots = plot_sweep(merged, "offered load (requests/s)", PLOTS_DIR, "slo_sweep",
                       title="tiergate serve, bundled model on this CPU: tiered vs fcfs")
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "policies": by_policy,
        "plots": [str(p.relative_to(paths.ROOT)) for p in plots],
    }


def _cell(stats: dict, key: str, q: str, scale: float = 1.0) -> str:
    value = stats.get(key, {}).get(q)  # a run before inter-token gaps were recorded has none
    return "-" if value is None else f"{value * scale:.2f}"


def render_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Open loop, {s['requests']} requests per rate, {s['premium_share']:.0%} premium; prompts 20-{s['max_prompt']}"
        f" tokens, outputs 16-{s['max_output']}; goodput counts requests within TTFT {s['premium_ttft_slo']} s "
        f"(premium) and {s['standard_ttft_slo']} s (standard).",
        "",
        "| policy | rate (req/s) | tier | ok / sent | 429 by reason | TTFT p50 / p99 (s) | TPOT p50 (ms) "
        "| inter-token gap p99 (ms) | e2e p99 (s) | goodput | preemptions |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for policy, points in result["policies"].items():
        for p in points:
            for tier, t in p["tiers"].items():
                rejected = ", ".join(f"{k}: {v}" for k, v in t["rejected_429"].items()) or "-"
                lines.append(
                    f"| {policy} | {p['offered']:g} | {tier} | {t['ok']} / {t['requests']} | {rejected} "
                    f"| {_cell(t, 'ttft_s', 'p50')} / {_cell(t, 'ttft_s', 'p99')} | {_cell(t, 'tpot_s', 'p50', 1e3)} "
                    f"| {_cell(t, 'inter_token_s', 'p99', 1e3)} "
                    f"| {_cell(t, 'e2e_s', 'p99')} | {t['goodput_fraction']:.0%} "
                    f"| {p['preemptions'].get(tier, 0):.0f} |"
                )
    lines += ["", *_observations(result)]
    return "\n".join(lines) + "\n"


def _observations(result: dict) -> list[str]:
    """One sentence per plot, from the numbers behind it."""
    policies = result["policies"]
    if not {"tiered", "fcfs"} <= policies.keys():
        return []
    top = policies["tiered"][-1]["offered"]

    def at_top(policy: str, tier: str, key: str, q: str = "p99"):
        t = policies[policy][-1]["tiers"].get(tier)
        return None if t is None else (t[key][q] if q else t[key])

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    return [
        f"Latency plot: at {top:g} req/s premium TTFT p99 is {fmt(at_top('tiered', 'premium', 'ttft_s'))} s under "
        f"tiered against {fmt(at_top('fcfs', 'premium', 'ttft_s'))} s under fcfs, while standard's is "
        f"{fmt(at_top('tiered', 'standard', 'ttft_s'))} s against {fmt(at_top('fcfs', 'standard', 'ttft_s'))} s.",
        f"Goodput plot: at {top:g} req/s {fmt(at_top('tiered', 'premium', 'goodput_fraction', None))} of premium "
        f"requests meet their SLO under tiered against {fmt(at_top('fcfs', 'premium', 'goodput_fraction', None))} "
        "under fcfs.",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.live.slo", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="2,4,8", help="offered loads, requests/s (about 1x, 2x, 4x this CPU)")
    p.add_argument("--requests", type=int, default=60, help="requests per rate (more than the 32 batch slots)")
    p.add_argument("--policies", default="tiered,fcfs")
    p.add_argument("--premium-share", type=float, default=0.3)
    p.add_argument("--premium-ttft-slo", type=float, default=2.0, help="seconds; scaled to this CPU, see above")
    p.add_argument("--standard-ttft-slo", type=float, default=20.0)
    p.add_argument("--max-prompt", type=int, default=120)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args)
    except RuntimeError as exc:
        print(f"slo_sweep: {exc}", file=sys.stderr)
        return 1
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
