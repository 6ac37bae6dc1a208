"""The batch tier on a virtual clock: what spare-capacity work costs interactive requests, and what it adds.

The real scheduler with the gateway's CPU defaults (read from gateway/settings.py, not copied: the
inter-token bound, the batch tier's step share and KV margin, express steps between layers) and a
linear step cost (bench/sim/slo.py's ``CostModel``; by default the coefficients in ``CPU_COST``, fitted to
the bundled model's steps on a 2-core Zen 4, bench/RESULTS.md; ``--cost-model`` for others), on
bench/live/batch_tier.py's workload: the interactive mix (30% premium, prompts of 20-200 tokens, 16-64
output tokens) in a closed loop of 16 for the capacity, then as Poisson arrivals at 70% of it, alone and
beside a batch that keeps ``batch_window`` lines (prompts of 20-120 tokens, 16 output tokens) running.
A request that arrives during a step runs between two of its layers when the scheduler's express
planning takes it, as the engine's step loop asks it, else after the step.

Per batch step share (``--shares``) and seed, alone and beside: interactive TTFT p50 / p99 per tier,
the mean and p99 gap between a stream's tokens, output tokens/s, the engine's busy share, and the
requests that arrived during a step of batch work alone and waited for its end. Without the live
bench's noise, so its ratios can be read against what the scheduler decides.

    .venv/bin/python -m bench.sim.batch_tier [--shares 0.2,0.5,1] [--seeds 3] [--duration 300]
        [--cost-model PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import asdict, dataclass, replace

from bench.common import report
from bench.common.stats import percentile
from bench.live import batch_tier as live_batch_tier
from bench.sim.slo import CostModel
from gateway.server import engine_config
from gateway.settings import load_settings
from scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan

CPU_COST = CostModel(base_s=6.1e-3, per_prefill_token_s=7.7e-4, per_decode_seq_s=5.3e-4, per_context_token_s=0.0,
                     num_layers=30)
NUM_BLOCKS = 4096  # of 16 tokens: room for every sequence, so the pool never decides
TIERS = ("premium", "standard")


@dataclass(frozen=True)
class Workload:
    load: float  # interactive arrivals as a share of the capacity
    premium_share: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    line_prompt: tuple[int, int]
    line_tokens: int
    capacity_concurrency: int
    capacity_requests: int

    @classmethod
    def of_live_bench(cls, **changes) -> Workload:
        """The live bench's workload, read from its defaults (bench/live/batch_tier.py), with ``changes``."""
        live = live_batch_tier.parse_args([])
        work = cls(load=live.load, premium_share=live.premium_share, prompt=(20, live.max_prompt),
                   output=(16, live.max_output), line_prompt=(20, live.line_prompt), line_tokens=live.line_tokens,
                   capacity_concurrency=live.capacity_concurrency, capacity_requests=live.capacity_requests)
        return replace(work, **changes)


def scheduler_config(batch_step_share: float) -> SchedulerConfig:
    settings = load_settings({"premium_ttft_slo_s": 2.0, "batch_step_share": batch_step_share},
                             environ={"TIERGATE_DEVICE": "cpu"})
    return engine_config(settings).scheduler_config(NUM_BLOCKS, 2048)


class _Run:
    """One virtual run: the clock, the scheduler, and what each request saw."""

    def __init__(self, config: SchedulerConfig, cost: CostModel, seed: int, work: Workload) -> None:
        self.now = 0.0
        self.sched = Scheduler(config, clock=lambda: self.now)
        self.cost, self.work = cost, work
        self.rng = random.Random(seed)  # the interactive requests' sizes: the same beside a batch as alone
        self.batch_rng = random.Random(seed + 10**6)
        self.ids = 0
        self.arrived: dict[str, float] = {}
        self.tier: dict[str, str] = {}
        self.tokens: dict[str, list[float]] = {}  # token times of the interactive requests
        self.open: set[str] = set()  # interactive requests not yet finished
        self.output = {"interactive": 0, "batch": 0}  # tokens made before the run's end
        self.engine_s = {"interactive": 0.0, "batch": 0.0}  # their steps' seconds, split as the engine meters them
        self.end = math.inf
        self.busy_s = 0.0
        self.batch_running: set[str] = set()
        self.in_batch_steps = self.waited = 0  # arrivals during a step of batch work alone; of them, after it

    def add(self, tier: str, prompt: int, max_tokens: int, at: float) -> str:
        self.ids += 1
        seq_id, base = f"{tier}-{self.ids}", 10**6 * self.ids  # unique prompts: no prefix-cache hits
        tenant = {"premium": "acme", "standard": "globex"}.get(tier, "bulk")
        self.sched.add(Sequence(seq_id, list(range(base, base + prompt)), tier=tier, max_tokens=max_tokens,
                                tenant=tenant))
        self.arrived[seq_id], self.tier[seq_id] = at, tier
        return seq_id

    def interactive(self, at: float) -> str:
        w = self.work
        tier = "premium" if self.rng.random() < w.premium_share else "standard"
        seq_id = self.add(tier, self.rng.randint(*w.prompt), self.rng.randint(*w.output), at)
        self.tokens[seq_id] = []
        self.open.add(seq_id)
        return seq_id

    def top_up_batch(self, window: int) -> None:
        while len(self.batch_running) < window:
            self.batch_running.add(self.add("batch", self.batch_rng.randint(*self.work.line_prompt),
                                            self.work.line_tokens, self.now))

    def apply(self, plan: StepPlan, timed: tuple[float, int], ends_at: float) -> list[str]:
        """A step that ends at ``ends_at``, ``timed`` (its seconds and prefill tokens, ``CostModel.step_time``): its
        tokens and finishes; returns the ids that finished."""
        duration, prefill = timed
        self.busy_s += duration
        if ends_at <= self.end:
            computed = sum(c.num_tokens for c in plan.chunks)
            for c in plan.chunks:
                self.engine_s["batch" if c.seq.tier == "batch" else "interactive"] += duration * c.num_tokens / computed
        sampling = [c.seq for c in plan.chunks if c.samples]
        self.sched.update(plan, {s.seq_id: 1 + s.num_tokens % 30000 for s in sampling})
        self.sched.observe_step(duration, plan.num_tokens, prefill, plan)
        finished = []
        for seq in sampling:
            if ends_at <= self.end:
                self.output["batch" if seq.tier == "batch" else "interactive"] += 1
            if seq.seq_id in self.tokens:
                self.tokens[seq.seq_id].append(ends_at)
            if len(seq.output_token_ids) >= seq.max_tokens:
                self.sched.finish(seq.seq_id)
                self.batch_running.discard(seq.seq_id)
                self.open.discard(seq.seq_id)
                finished.append(seq.seq_id)
        return finished

    def step(self, arrivals: deque[float]) -> None:
        """Plan and run one step; ``arrivals`` (ascending times, consumed) that come during it are added, and the
        first that the scheduler's express planning takes runs between two of its layers (the engine allows
        one such step a tenth of a second, engine/express_steps.py: about one a step here)."""
        while arrivals and arrivals[0] <= self.now:
            self.interactive(arrivals.popleft())
        plan = self.sched.schedule()
        if plan.is_empty:
            if not arrivals:
                raise RuntimeError("the scheduler planned nothing with work left")
            self.now = arrivals[0]
            return
        timed = self.cost.step_time(plan)
        duration = timed[0]
        started, ends_at = self.now, self.now + duration
        under_way = frozenset(c.seq.seq_id for c in plan.chunks)
        batch_alone = all(c.seq.tier == "batch" for c in plan.chunks)
        expressed = False
        while arrivals and arrivals[0] < ends_at:
            at = arrivals.popleft()
            self.interactive(at)
            if expressed:
                continue
            layer_s = duration / self.cost.num_layers
            self.now = min(started + math.ceil((at - started) / layer_s) * layer_s, ends_at)
            between = self.sched.schedule_express(frozenset(), under_way)
            if batch_alone:
                self.in_batch_steps += 1
                self.waited += between.is_empty
            if not between.is_empty:
                express = self.cost.step_time(between)
                self.apply(between, express, self.now + express[0])
                ends_at, expressed = ends_at + express[0], True
        self.now = ends_at
        self.apply(plan, timed, ends_at)


def capacity_rps(config: SchedulerConfig, cost: CostModel, work: Workload, seed: int) -> float:
    """As the live bench measures it: ``capacity_requests`` interactive requests over the time they take, at
    most ``capacity_concurrency`` in flight (the next one starts as one finishes)."""
    run = _Run(config, cost, seed, work)
    started = min(work.capacity_concurrency, work.capacity_requests)
    for _ in range(started):
        run.interactive(0.0)
    while run.open:
        plan = run.sched.schedule()
        timed = cost.step_time(plan)
        run.now += timed[0]
        for _ in run.apply(plan, timed, run.now):
            if started < work.capacity_requests:
                started += 1
                run.interactive(run.now)
    return work.capacity_requests / run.now


def phase(config: SchedulerConfig, cost: CostModel, work: Workload, rate: float, duration_s: float, seed: int,
          batch_window: int) -> dict:
    """Poisson interactive arrivals for ``duration_s`` (the same for a seed whatever else runs), beside a batch
    of ``batch_window`` running lines when that is not 0; runs until every interactive request has its tokens."""
    times, at, arrival_rng = deque(), 0.0, random.Random(seed)
    while (at := at + arrival_rng.expovariate(rate)) < duration_s:
        times.append(at)
    run = _Run(config, cost, seed, work)
    run.end = duration_s
    while times or run.open:
        if batch_window and run.now < duration_s:
            run.top_up_batch(batch_window)
        run.step(times)
    ttft = {tier: [v[0] - run.arrived[k] for k, v in run.tokens.items() if run.tier[k] == tier] for tier in TIERS}
    gaps = [b - a for v in run.tokens.values() for a, b in zip(v, v[1:])]
    return {
        **{f"ttft_p50_{t}": percentile(ttft[t], 50) for t in TIERS},
        **{f"ttft_p99_{t}": percentile(ttft[t], 99) for t in TIERS},
        "gap_mean_s": statistics.fmean(gaps), "gap_p99_s": percentile(gaps, 99),
        "tokens_per_s": (run.output["interactive"] + run.output["batch"]) / duration_s,
        "batch_tokens_per_s": run.output["batch"] / duration_s,
        "busy": run.busy_s / run.now,
        **{f"ms_per_token_{side}": 1000 * run.engine_s[side] / run.output[side] if run.output[side] else None
           for side in ("interactive", "batch")},
        "arrivals_in_batch_steps": run.in_batch_steps, "waited_for_batch_step": run.waited,
        "interactive_requests": len(run.tokens),
    }


def run(shares: list[float], cost: CostModel, work: Workload, duration_s: float, seeds: int) -> dict:
    """Per share and seed, the load alone and beside the batch; the capacity measured under the first share."""
    window = load_settings(environ={"TIERGATE_DEVICE": "cpu"}).batch_window
    capacity = capacity_rps(scheduler_config(shares[0]), cost, work, seed=0)
    rate = work.load * capacity
    rows = []
    for share in shares:
        config = scheduler_config(share)
        for seed in range(seeds):
            alone = phase(config, cost, work, rate, duration_s, seed, 0)
            beside = phase(config, cost, work, rate, duration_s, seed, window)
            rows.append({"share": share, "seed": seed, "alone": alone, "beside": beside, "ratios": ratios(alone, beside)})
    return {"cost_model": asdict(cost), "workload": asdict(work), "duration_s": duration_s, "batch_window": window,
            "capacity_rps": capacity, "rate_rps": rate, "rows": rows}


def ratios(alone: dict, beside: dict) -> dict:
    out = {f"ttft_p{q}_{t}": beside[f"ttft_p{q}_{t}"] / alone[f"ttft_p{q}_{t}"] for q in (50, 99) for t in TIERS}
    out["gap_mean"] = beside["gap_mean_s"] / alone["gap_mean_s"]
    out["tokens"] = beside["tokens_per_s"] / alone["tokens_per_s"]
    return out


def render_markdown(result: dict) -> str:
    c, w = result["cost_model"], result["workload"]
    lines = [
        f"Virtual clock, {result['duration_s']:g} s a phase. Step cost {c['base_s'] * 1e3:.2f} ms + "
        f"{c['per_prefill_token_s'] * 1e3:.2f} ms a prefill token + {c['per_decode_seq_s'] * 1e3:.2f} ms a decode row, "
        f"{c['num_layers']} layers. Capacity ({w['capacity_requests']} requests, "
        f"{w['capacity_concurrency']} at a time) "
        f"{result['capacity_rps']:.2f} requests/s; load {w['load']:.0%} of it. Batch lines: prompts "
        f"{w['line_prompt'][0]}-{w['line_prompt'][1]} tokens, {w['line_tokens']} output tokens, "
        f"{result['batch_window']} running.",
        "",
        "| batch step share | seed | premium TTFT p50 / p99 ratio | standard TTFT p50 / p99 ratio | mean gap ratio "
        "| tokens/s alone / beside (ratio) | busy alone / beside | engine ms a token: interactive alone / beside, "
        "batch | arrivals in batch steps / waited |",
        "|---:|---:|---|---|---:|---|---|---|---|",
    ]
    for row in result["rows"]:
        a, b, r = row["alone"], row["beside"], row["ratios"]
        lines.append(
            f"| {row['share']:g} | {row['seed']} | {r['ttft_p50_premium']:.2f} / {r['ttft_p99_premium']:.2f} "
            f"| {r['ttft_p50_standard']:.2f} / {r['ttft_p99_standard']:.2f} | {r['gap_mean']:.2f} "
            f"| {a['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} (**{r['tokens']:.2f}x**) "
            f"| {a['busy']:.2f} / {b['busy']:.2f} | {_ms(a['ms_per_token_interactive'])} / "
            f"{_ms(b['ms_per_token_interactive'])}, {_ms(b['ms_per_token_batch'])} "
            f"| {b['arrivals_in_batch_steps']} / {b['waited_for_batch_step']} |")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.batch_tier", description=__doc__.split("\n\n")[0])
    p.add_argument("--shares", default="0.2", help="batch step shares to compare, comma-separated")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--duration", type=float, default=300.0, help="virtual seconds of interactive arrivals a phase")
    p.add_argument("--cost-model", help="JSON of fitted step-cost coefficients (default: CPU_COST)")
    live = Workload.of_live_bench()
    p.add_argument("--load", type=float, default=live.load, help="interactive arrivals, a share of the capacity")
    p.add_argument("--line-prompt", default="%d:%d" % live.line_prompt, help="batch lines' prompt tokens, MIN:MAX")
    p.add_argument("--line-tokens", type=int, default=live.line_tokens, help="batch lines' output tokens")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    try:
        shares = [float(s) for s in args.shares.split(",")]
    except ValueError:
        p.error(f"--shares must be numbers, not {args.shares!r}")
    try:
        line_prompt = tuple(int(n) for n in args.line_prompt.split(":"))
    except ValueError:
        p.error(f"--line-prompt must be MIN:MAX, not {args.line_prompt!r}")
    if len(line_prompt) != 2 or not 1 <= line_prompt[0] <= line_prompt[1]:
        p.error(f"--line-prompt must be MIN:MAX with 1 <= MIN <= MAX, not {args.line_prompt!r}")
    if any(s < 0 for s in shares) or args.seeds < 1 or args.duration <= 0 or args.line_tokens < 1:
        p.error("--shares must be zero or more; --seeds, --duration and --line-tokens positive")
    if not 0 < args.load < 1:
        p.error("--load must be in (0, 1)")
    work = Workload.of_live_bench(load=args.load, line_prompt=line_prompt, line_tokens=args.line_tokens)
    try:
        cost = CostModel.load(args.cost_model) if args.cost_model else CPU_COST
    except (OSError, ValueError, TypeError) as exc:
        p.error(f"--cost-model {args.cost_model}: {exc}")
    report.finish(run(shares, cost, work, args.duration, args.seeds), args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
