"""Fair share on a virtual clock: a light standard tenant beside a flooding one, with and without fair share.

The real scheduler and bench/sim/slo.py's step-cost model (its stated H100
coefficients unless ``--cost-model`` names a fitted one). Tenant "flood" keeps
30 long requests outstanding (a new one as each finishes); tenant "light"
sends a short request every second. For each policy the light tenant's TTFT
is measured alone and beside the flood, from its arrival (so the step under
way when it arrives counts) and from the first step boundary after it (the
part that scheduling decides); the flood run's
throughput (prompt tokens prefilled for the first time plus tokens generated,
per second) is compared with fcfs's. Policies: ``tiered`` (fair share inside
the tier with express steps between a step's layers, the engine's default),
``tiered-step-end`` (fair share, the light request planned only at step
boundaries), ``tiered-nofair`` (FCFS inside the tier, as before fair share) and
``fcfs``. The KV pool is sized so the flood alone overfills the
standard tier's share: that backlog is what a light tenant waits behind.

    .venv/bin/python -m bench.sim.fair_share [--cost-model PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass

from bench.common import report
from bench.common.stats import percentile
from bench.sim.slo import CostModel, SimSettings, scheduler_config
from scheduler import Scheduler, Sequence

# (name, scheduler policy, fair share, express steps between layers)
POLICIES = (("tiered", "tiered", True, True), ("tiered-step-end", "tiered", True, False),
            ("tiered-nofair", "tiered", False, False), ("fcfs", "fcfs", True, False))


@dataclass(frozen=True)
class Scenario:
    duration_s: float = 120.0
    flood_concurrency: int = 30
    flood_prompt: int = 1024
    flood_max_tokens: int = 256
    light_every_s: float = 1.0
    light_prompt: int = 128
    light_max_tokens: int = 32
    num_blocks: int = 2048  # of 16 tokens: standard's 70% holds about 18 flood requests, not 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    premium_kv_reserve: float = 0.3  # kept free of standard even with no premium traffic (tiered only)


class _Run:
    """One virtual run's clock, scheduler and records."""

    def __init__(self, sc: Scenario, policy: str, fair: bool) -> None:
        self.now = 0.0
        settings = SimSettings(num_blocks=sc.num_blocks, max_num_seqs=sc.max_num_seqs,
                               max_num_batched_tokens=sc.max_num_batched_tokens, standard_min_share=0.1,
                               premium_kv_reserve=sc.premium_kv_reserve)
        self.sched = Scheduler(scheduler_config(settings, policy, fair), clock=lambda: self.now)
        self.sc = sc
        self.ids = itertools.count()
        self.arrived: dict[str, float] = {}
        self.seen: dict[str, float] = {}  # when the scheduler could first plan it: a step boundary, or a layer's
        self.first: dict[str, float] = {}
        self.useful_tokens = 0

    def submit(self, tenant: str, prompt: int, max_tokens: int, at: float) -> str:
        n = next(self.ids)
        seq_id = f"{tenant}-{n}"
        base = 10**6 * (n + 1)  # unique tokens: no prefix-cache hits between requests
        self.sched.add(Sequence(seq_id, list(range(base, base + prompt)), tier="standard", tenant=tenant,
                                max_tokens=max_tokens))
        self.arrived[seq_id] = at
        self.seen[seq_id] = max(at, self.now)
        return seq_id

    def finish_step(self, plan, duration: float, prefill: int, ends_at: float) -> None:
        """Apply a step that ends at ``ends_at``: tokens, first-token times, finishes (the flood resubmits)."""
        sched = self.sched
        for c in plan.chunks:
            self.useful_tokens += max(0, min(c.end, c.seq.num_prompt_tokens) - max(c.start, c.seq.recompute_until))
        sampling = [c.seq for c in plan.chunks if c.samples]
        sched.update(plan, {s.seq_id: 1 + s.num_tokens % 30000 for s in sampling})
        sched.observe_step(duration, plan.num_tokens, prefill)
        self.useful_tokens += len(sampling)
        for seq in sampling:
            self.first.setdefault(seq.seq_id, ends_at)
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq.seq_id)
                if seq.tenant == "flood":
                    self.submit("flood", self.sc.flood_prompt, self.sc.flood_max_tokens, ends_at)


def run_policy(sc: Scenario, cost: CostModel, policy: str, fair: bool, flood: bool, express: bool = False) -> dict:
    """One virtual run; light TTFTs (a request still without a token at the end counts its wait so far).

    With ``express``, as the engine's step loop does: a light request that arrives during a step
    is offered to ``Scheduler.schedule_express`` at once; if planned, it runs at the step's next
    layer boundary (the step's time over ``cost.num_layers``) and the step ends that much later
    (at most one such step per step); at a step boundary, one that qualifies gets a step of its
    own before the next (never two in a row).
    """
    r = _Run(sc, policy, fair)
    if flood:
        for _ in range(sc.flood_concurrency):
            r.submit("flood", sc.flood_prompt, sc.flood_max_tokens, 0.0)
    next_light, express_ran = 0.5, False
    while r.now < sc.duration_s:
        while next_light <= r.now:
            r.submit("light", sc.light_prompt, sc.light_max_tokens, next_light)
            next_light += sc.light_every_s
        if express and not express_ran:  # at a step boundary: a step of its own first, never two in a row
            own = r.sched.schedule_express()
            if not own.is_empty:
                duration, prefill = cost.step_time(own)
                r.now += duration
                r.finish_step(own, duration, prefill, r.now)
                express_ran = True
                continue
        express_ran = False
        plan = r.sched.schedule()
        if plan.is_empty:
            r.now = next_light
            continue
        duration, prefill = cost.step_time(plan)
        started, ends_at, expressed, waits = r.now, r.now + duration, False, []
        while express and not expressed and next_light < ends_at:
            waits.append(r.submit("light", sc.light_prompt, sc.light_max_tokens, next_light))
            arrival, next_light = next_light, next_light + sc.light_every_s
            between = r.sched.schedule_express(frozenset())
            if between.is_empty:
                continue
            layer_s = duration / cost.num_layers
            boundary = started + math.ceil((arrival - started) / layer_s) * layer_s
            express_s, express_prefill = cost.step_time(between)
            for c in between.chunks:
                r.seen[c.seq.seq_id] = boundary
                waits.remove(c.seq.seq_id)
            r.finish_step(between, express_s, express_prefill, boundary + express_s)
            ends_at, expressed = ends_at + express_s, True
        for seq_id in waits:  # arrived during the step, planned at its end
            r.seen[seq_id] = ends_at
        r.now = ends_at
        r.finish_step(plan, duration, prefill, ends_at)
    light = [r.first.get(i, r.now) - t for i, t in r.arrived.items() if i.startswith("light")]
    scheduled = [r.first.get(i, r.now) - t for i, t in r.seen.items() if i.startswith("light")]
    return {"light_ttft_p50_s": percentile(light, 50), "light_ttft_p99_s": percentile(light, 99),
            "light_from_step_p99_s": percentile(scheduled, 99),
            "light_requests": len(light), "light_without_token": sum(1 for i in r.arrived if i.startswith("light")
                                                                      and i not in r.first),
            "tokens_per_s": r.useful_tokens / r.now}


def run(sc: Scenario, cost: CostModel) -> dict:
    rows = {}
    for name, policy, fair, express in POLICIES:
        alone = run_policy(sc, cost, policy, fair, flood=False, express=express)
        flooded = run_policy(sc, cost, policy, fair, flood=True, express=express)
        rows[name] = {"alone": alone, "flood": flooded,
                        "p99_ratio": flooded["light_ttft_p99_s"] / alone["light_ttft_p99_s"],
                        "from_step_p99_ratio": flooded["light_from_step_p99_s"] / alone["light_from_step_p99_s"]}
    throughput = rows["tiered"]["flood"]["tokens_per_s"] / rows["fcfs"]["flood"]["tokens_per_s"]
    fairness_cost = rows["tiered"]["flood"]["tokens_per_s"] / rows["tiered-nofair"]["flood"]["tokens_per_s"]
    goals = [
        {"goal": "light TTFT p99 beside the flood within 2x of alone (tiered, fair share)",
         "value": rows["tiered"]["p99_ratio"], "met": rows["tiered"]["p99_ratio"] <= 2},
        {"goal": "the same from the first step boundary after arrival (the wait that scheduling decides)",
         "value": rows["tiered"]["from_step_p99_ratio"], "met": rows["tiered"]["from_step_p99_ratio"] <= 2},
        {"goal": "fcfs far worse: its ratio at least 5x tiered's",
         "value": rows["fcfs"]["p99_ratio"] / rows["tiered"]["p99_ratio"],
         "met": rows["fcfs"]["p99_ratio"] >= 5 * rows["tiered"]["p99_ratio"]},
        # A loss is what the goal guards against: serving more than fcfs costs nothing.
        {"goal": "throughput beside the flood at most 5% below fcfs (tiered / fcfs)", "value": throughput,
         "met": throughput >= 0.95},
        {"goal": "fair share costs under 5% of throughput (tiered / tiered-nofair, same KV reserve)",
         "value": fairness_cost, "met": fairness_cost >= 0.95},
    ]
    return {"scenario": asdict(sc), "cost_model": asdict(cost), "policies": rows, "goals": goals}


def render_markdown(result: dict) -> str:
    sc = result["scenario"]
    lines = [
        f"Virtual clock, {sc['duration_s']:g} s per run. Flood: {sc['flood_concurrency']} requests outstanding, "
        f"{sc['flood_prompt']} prompt + {sc['flood_max_tokens']} output tokens; light: one request every "
        f"{sc['light_every_s']:g} s, {sc['light_prompt']} + {sc['light_max_tokens']} tokens. KV pool "
        f"{sc['num_blocks']} blocks of 16, {sc['max_num_seqs']} sequences, {sc['max_num_batched_tokens']} tokens "
        f"a step; premium KV reserve {sc['premium_kv_reserve']:.0%} (tiered policies). "
        f"Step cost: {result['cost_model']}.",
        "",
        "| policy | light TTFT p50 / p99 alone (s) | light TTFT p50 / p99 beside the flood (s) | p99 ratio "
        "| p99 ratio from the next step | tokens/s beside the flood |",
        "|---|---|---|---:|---:|---:|",
    ]
    for policy, r in result["policies"].items():
        a, f = r["alone"], r["flood"]
        lines.append(f"| {policy} | {a['light_ttft_p50_s']:.3f} / {a['light_ttft_p99_s']:.3f} "
                     f"| {f['light_ttft_p50_s']:.3f} / {f['light_ttft_p99_s']:.3f} | {r['p99_ratio']:.1f}x "
                     f"| {r['from_step_p99_ratio']:.1f}x "
                     f"| {f['tokens_per_s']:.0f} |")
    lines += ["", *[f"- [{'MET' if g['met'] else 'MISSED'}] {g['goal']}: {g['value']:.3g}" for g in result["goals"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.fair_share", description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-model", help="JSON of fitted step-cost coefficients (default: stated H100 ones)")
    p.add_argument("--duration", type=float, default=Scenario.duration_s, help="virtual seconds per run")
    p.add_argument("--premium-reserve", type=float, default=Scenario.premium_kv_reserve,
                   help="share of the KV pool kept for premium under tiered (0 compares like for like with fcfs)")
    p.add_argument("--step-tokens", type=int, default=Scenario.max_num_batched_tokens,
                   help="max_num_batched_tokens: the longest step, hence the longest wait for the step under way")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.duration <= 0:
        p.error("--duration must be positive")
    if args.step_tokens < 1:
        p.error("--step-tokens must be positive")
    if not 0 <= args.premium_reserve < 1:
        p.error("--premium-reserve must be in [0, 1)")
    try:
        cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    except (OSError, ValueError, TypeError) as exc:
        p.error(f"--cost-model {args.cost_model}: {exc}")
    result = run(Scenario(duration_s=args.duration, premium_kv_reserve=args.premium_reserve,
                          max_num_batched_tokens=args.step_tokens), cost)
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
