"""SLO simulation with long prompts beside premium streams: the inter-token latency bound off and on.

The real scheduler on a virtual clock (bench/sim/slo.py's loop and cost model). Premium tenants
stream: short prompts (32-256 tokens), long outputs (128-384). Standard tenants send long prompts
(1,500-3,500 tokens, the size of issue 31's 1,987-token one) with short outputs (16-64). Each load runs twice on the same requests: as before the bound existed, and with
the bound at the gateway's defaults for the machine the cost model describes (gateway/settings.py:
premium TPOT 100 ms and every step 150 ms on a CPU, 25 / 50 ms on a GPU; on a CPU a step with nobody
decoding 500 ms).

Reported per tier: TTFT p50 / p99, the inter-token gap p50 / p99 / max (every gap between two
tokens of a request, in virtual time), the tokens served per second of the run, and capacity: tokens
computed per second with every request queued at t=0. Goals, at each load: premium p99 gap under its target, premium TTFT p99 within its
SLO (0.5 s on the GPU coefficients, 2 s on a CPU's, the gateway's defaults), capacity at least 90%
of the unbounded run's.

    .venv/bin/python -m bench.sim.long_prompts [--cost-model bench/out/step_cost.json] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, replace

from bench.common import report
from bench.common.stats import percentile
from bench.sim.slo import CostModel, Request, SimSettings, simulate
from gateway.settings import load_settings

LOADS = (0.5, 0.8)


def gateway_defaults(device: str) -> dict:
    """The bound (premium TPOT SLO, every step's, and on a CPU a multiple of the streams' decodes alone) and
    premium's TTFT SLO as the gateway sets them by default on ``device``: read from gateway/settings.py, not copied."""
    s = load_settings(environ={"TIERGATE_DEVICE": device})
    return dict(premium_tpot_slo_s=s.premium_tpot_s, max_step_s=s.step_bound_s, step_bound_factor=s.step_factor,
                max_prefill_step_s=s.prefill_step_bound_s, premium_slo_s=s.premium_slo_s)


# A CPU's steps also take the engine's default batch (512 tokens, 32 sequences; engine/config.py):
# bench/sim/slo.py's 2,048-token steps would last over a second on one.
CPU = dict(gateway_defaults("cpu"), max_num_batched_tokens=512, max_num_seqs=32)
GPU = gateway_defaults("cuda")


def workload(num_requests: int, rate_per_s: float | None, seed: int = 0) -> list[Request]:
    """Half premium streams, half standard long prompts; ``rate_per_s`` None: all at t=0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num_requests):
        if rate_per_s is not None:
            t += rng.expovariate(rate_per_s)
        streaming = rng.random() < 0.5
        n = rng.randint(32, 256) if streaming else rng.randint(1500, 3500)
        tier = "premium" if streaming else "standard"
        out.append(Request(
            request_id=f"{'s' if streaming else 'l'}{i}", arrival_s=t, tier=tier,
            prompt=tuple(range(10**9 + i * 10**4, 10**9 + i * 10**4 + n)),
            max_tokens=rng.randint(128, 384) if streaming else rng.randint(16, 64), adapter=None,
            tenant=f"{tier}-{i % 4}",
        ))
    return out


def _gaps(times: dict[str, list[float]], requests: list[Request], tier: str) -> list[float]:
    return [b - a for r in requests if r.tier == tier for a, b in zip(times[r.request_id], times[r.request_id][1:])]


def run_once(s: SimSettings, requests: list[Request], cost: CostModel) -> dict:
    times: dict[str, list[float]] = {}
    outcomes, makespan = simulate(s, "tiered", requests, cost, times)
    out: dict = {"tokens_per_s": sum(len(r.prompt) + r.max_tokens for r in requests) / makespan}
    for tier in ("premium", "standard"):
        ttfts = [o.ttft_s for o in outcomes if o.request.tier == tier]
        gaps = _gaps(times, requests, tier)
        out[tier] = {"requests": len(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                     "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99),
                     "gap_max_s": max(gaps, default=None)}
    return out


def capacity_tokens_per_s(s: SimSettings, requests: list[Request], cost: CostModel) -> float:
    queued = [replace(r, arrival_s=0.0) for r in requests]
    _, makespan = simulate(s, "tiered", queued, cost)
    return sum(len(r.prompt) + r.max_tokens for r in queued) / makespan


def run(cost: CostModel, machine: dict, num_requests: int, seed: int) -> dict:
    on = SimSettings(seed=seed, num_requests=num_requests, **machine)
    off = replace(on, max_step_s=None, premium_tpot_slo_s=None, step_bound_factor=None, max_prefill_step_s=None)
    premium_tpot, max_step, premium_slo = on.premium_tpot_slo_s, on.max_step_s, on.premium_slo_s
    capacity = {name: capacity_tokens_per_s(s, workload(num_requests, None, seed), cost)
                for name, s in (("off", off), ("on", on))}
    mean_tokens = sum(len(r.prompt) + r.max_tokens for r in workload(num_requests, None, seed)) / num_requests
    rows = []
    for load in LOADS:
        rate = load * capacity["off"] / mean_tokens
        requests = workload(num_requests, rate, seed)
        rows.append({"load": load, "rate_req_per_s": rate,
                     "off": run_once(off, requests, cost), "on": run_once(on, requests, cost)})
    goals = []
    for row in rows:
        p = row["on"]["premium"]
        goals.append({"goal": f"{row['load']}x: premium p99 inter-token gap under its {premium_tpot:g} s target",
                      "value": p["gap_p99_s"], "met": p["gap_p99_s"] <= premium_tpot})
        goals.append({"goal": f"{row['load']}x: premium TTFT p99 within its {premium_slo:g} s SLO",
                      "value": p["ttft_p99_s"], "met": p["ttft_p99_s"] <= premium_slo})
    ratio = capacity["on"] / capacity["off"]
    goals.append({"goal": "capacity with the bound at least 90% of without", "value": ratio, "met": ratio >= 0.9})
    return {"cost_model": asdict(cost), "premium_tpot_slo_s": premium_tpot, "max_step_s": max_step,
            "step_bound_factor": on.step_bound_factor, "max_prefill_step_s": on.max_prefill_step_s,
            "premium_ttft_slo_s": premium_slo, "max_num_batched_tokens": on.max_num_batched_tokens,
            "max_num_seqs": on.max_num_seqs, "capacity_tokens_per_s": capacity, "rows": rows, "goals": goals}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_markdown(result: dict) -> str:
    lines = []
    for name, r in result["runs"].items():
        cap = r["capacity_tokens_per_s"]
        lines += [f"**{name}**: cost {r['cost_model']}; bound: premium TPOT {r['premium_tpot_slo_s']:g} s, every step "
                  f"{r['max_step_s']:g} s, and {r.get('step_bound_factor') or '-'} times the streams' decodes alone; "
                  f"with nobody decoding {r.get('max_prefill_step_s') or '-'} s; "
                  f"premium TTFT SLO {r['premium_ttft_slo_s']:g} s; steps of up to "
                  f"{r['max_num_batched_tokens']} tokens and {r['max_num_seqs']} sequences; capacity "
                  f"{cap['off']:.0f} tokens/s without the bound, {cap['on']:.0f} with.", "",
                  "| load | bound | tier | TTFT p50 / p99 (s) | gap p50 / p99 / max (ms) | served (tokens/s) |",
                  "|---|---|---|---|---|---:|"]
        for row in r["rows"]:
            for bound in ("off", "on"):
                for tier in ("premium", "standard"):
                    t = row[bound][tier]
                    lines.append(f"| {row['load']}x ({row['rate_req_per_s']:.2f} req/s) | {bound} | {tier} "
                                 f"| {_s(t['ttft_p50_s'])} / {_s(t['ttft_p99_s'])} "
                                 f"| {_ms(t['gap_p50_s'])} / {_ms(t['gap_p99_s'])} / {_ms(t['gap_max_s'])} "
                                 f"| {row[bound]['tokens_per_s']:.0f} |")
        lines.append("")
        lines += [f"- [{'MET' if g['met'] else 'MISSED'}] {g['goal']}: {g['value']:.3g}" for g in r["goals"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", help="JSON of step-cost coefficients fitted to this CPU (bench/sim/step_cost.py)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error("--requests must be at least 10")
    runs = {"GPU coefficients (bench/sim/slo.py's H100 figures)": (CostModel(), GPU)}
    if args.cost_model:
        try:
            runs[f"this CPU's fitted cost ({args.cost_model})"] = (CostModel.load(args.cost_model), CPU)
        except (OSError, ValueError, TypeError) as exc:
            p.error(f"--cost-model {args.cost_model}: {exc}")
    result = {"runs": {name: run(cost, machine, args.requests, args.seed) for name, (cost, machine) in runs.items()}}
    report.finish(result, args.json, render_markdown)
    return 0 if all(g["met"] for r in result["runs"].values() for g in r["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
