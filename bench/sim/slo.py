"""SLO simulation: the real scheduler on a virtual clock, tiered against fcfs.

Each step's duration comes from a cost model,
``a + b * prefill_tokens + c * decode_seqs + d * context_tokens``, so thousands
of requests run in seconds. The same seeded workload (Poisson arrivals, 20%
premium, mixed prompt and output lengths, shared system prompts, adapters) is
offered at 0.5x to 3x the capacity the cost model gives, to both policies.

Default coefficients: Llama-3-8B in bf16 on one H100 (numbers stated, not
measured here): each step reads 16 GB of weights at ~3 TB/s, so a = 6 ms with
launch overhead; a prefill token costs 2 * 8e9 FLOP at ~400 TFLOP/s sustained,
so b = 40 us; a decode row adds sampling and under-utilised matmul work,
c = 20 us; a context token is 128 KiB of keys and values read per step at
~3 TB/s, d = 44 ns; 32 layers. The KV pool is kept tight (64k tokens) so that memory,
not only compute, is contended. ``--cost-model PATH`` loads coefficients
fitted to the real engine from JSON: {"base_s", "per_prefill_token_s",
"per_decode_seq_s", "per_context_token_s", "num_layers"}.

The SLOs (premium 0.5 s, standard's 5 s yardstick) are stated for the GPU
coefficients. With a fitted cost model they are scaled by how much slower that
machine is: the GPU coefficients' capacity over the fitted model's capacity on
the same workload (``--slo-scale auto``, the default), so "2x load" and "within
SLO" mean the same queueing on both machines. ``--slo-scale 1`` keeps them as is.

    .venv/bin/python -m bench.sim.slo [--json out.json] [--cost-model fit.json] [--slo-scale auto|X]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, replace

from bench.common import report
from bench.common.stats import percentile
from scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan
from scheduler.config import StepCost, default_tiers
from scheduler.step_cost import predict, step_features

LOADS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class CostModel:
    base_s: float = 6e-3
    per_prefill_token_s: float = 40e-6
    per_decode_seq_s: float = 20e-6
    per_context_token_s: float = 44e-9
    # Layer boundaries, where an express step may run inside a step (bench/sim/fair_share.py).
    num_layers: int = 32

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            fields = json.load(f)
        return cls(**{k: type(getattr(cls, k))(v) for k, v in fields.items() if k in cls.__dataclass_fields__})

    def step_time(self, plan: StepPlan) -> tuple[float, int]:
        """(seconds, prefill tokens) of one planned step."""
        features = step_features(plan)
        cost = StepCost(self.base_s, self.per_prefill_token_s, self.per_decode_seq_s, self.per_context_token_s)
        return predict(cost, features), features.prefill_tokens


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float
    tier: str
    prompt: tuple[int, ...]
    max_tokens: int
    adapter: str | None
    tenant: str | None = None


@dataclass
class SimSettings:
    seed: int = 0
    num_requests: int = 1000
    premium_fraction: float = 0.2
    premium_slo_s: float = 0.5
    standard_slo_s: float = 5.0  # standard has no SLO to keep; goodput still needs a yardstick
    num_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    max_loras: int = 4
    standard_min_share: float = 0.1
    premium_kv_reserve: float = 0.3
    # The inter-token latency bound (scheduler/step_budget.py); None: off, as before it existed.
    max_step_s: float | None = None
    premium_tpot_slo_s: float | None = None
    step_bound_factor: float | None = None
    max_prefill_step_s: float | None = None


def scheduler_config(s: SimSettings, policy: str, fair_share: bool = True) -> SchedulerConfig:
    tiers = default_tiers(s.premium_slo_s, s.premium_kv_reserve, s.standard_slo_s, s.premium_tpot_slo_s)
    return SchedulerConfig(
        num_blocks=s.num_blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        max_loras=s.max_loras,
        policy=policy,
        fair_share=fair_share,
        tiers=tiers,
        standard_min_share=s.standard_min_share,
        max_step_s=s.max_step_s,
        step_bound_factor=s.step_bound_factor,
        max_prefill_step_s=s.max_prefill_step_s,
    )


def workload(s: SimSettings, rate_per_s: float | None) -> list[Request]:
    """Seeded requests; ``rate_per_s`` None puts them all at t=0 (to measure capacity)."""
    rng = random.Random(s.seed)
    system_prompts = [tuple(range(10**6 * (k + 1), 10**6 * (k + 1) + 256)) for k in range(4)]
    t = 0.0
    out = []
    for i in range(s.num_requests):
        if rate_per_s is not None:
            t += rng.expovariate(rate_per_s)
        kind = rng.random()
        n = rng.randint(32, 512) if kind < 0.6 else rng.randint(512, 2048) if kind < 0.9 else rng.randint(2048, 3584)
        shared = system_prompts[rng.randrange(4)] if rng.random() < 0.5 and n > 256 else ()
        unique = tuple(range(10**9 + i * 10**4, 10**9 + i * 10**4 + n - len(shared)))
        out.append(
            Request(
                request_id=f"r{i}",
                arrival_s=t,
                tier="premium" if rng.random() < s.premium_fraction else "standard",
                prompt=shared + unique,
                max_tokens=rng.randint(16, 256),
                adapter=rng.choice([None, None, None, "sql", "support", "legal"]),
            )
        )
    return out


@dataclass
class Outcome:
    request: Request
    ttft_s: float
    predicted_ttft_s: float  # the scheduler's load() estimate when it arrived
    preemptions: int


def simulate(s: SimSettings, policy: str, requests: list[Request], cost: CostModel,
             token_times: dict[str, list[float]] | None = None) -> tuple[list[Outcome], float]:
    """Run ``requests`` to completion; (outcomes, makespan in virtual seconds). ``token_times``, if given,
    gets each request's token times."""
    now = 0.0
    sched = Scheduler(scheduler_config(s, policy), clock=lambda: now)
    first_token: dict[str, float] = {}
    predicted: dict[str, float] = {}
    seqs: dict[str, Sequence] = {}
    pending = sorted(requests, key=lambda r: r.arrival_s)
    nxt = 0
    while nxt < len(pending) or sched.has_unfinished():
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            r = pending[nxt]
            seq = Sequence(r.request_id, list(r.prompt), tier=r.tier, adapter=r.adapter,
                           max_tokens=r.max_tokens, tenant=r.tenant)
            predicted[r.request_id] = sched.load()[r.tier].predicted_ttft_s
            sched.add(seq)
            seqs[r.request_id] = seq
            nxt += 1
        plan = sched.schedule()
        if plan.is_empty:
            if nxt == len(pending):
                raise RuntimeError("scheduler stalled with work left")
            now = max(now, pending[nxt].arrival_s)
            continue
        duration, prefill = cost.step_time(plan)
        sampling = [c.seq for c in plan.chunks if c.samples]
        now += duration
        sched.update(plan, {seq.seq_id: 1 + seq.num_tokens % 30000 for seq in sampling})
        sched.observe_step(duration, plan.num_tokens, prefill, plan)
        for seq in sampling:
            first_token.setdefault(seq.seq_id, now)
            if token_times is not None:
                token_times.setdefault(seq.seq_id, []).append(now)
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq.seq_id)
    outcomes = [
        Outcome(r, first_token[r.request_id] - r.arrival_s, predicted[r.request_id], seqs[r.request_id].num_preemptions)
        for r in requests
    ]
    return outcomes, now


def summarize(s: SimSettings, outcomes: list[Outcome]) -> dict[str, dict]:
    slo = {"premium": s.premium_slo_s, "standard": s.standard_slo_s}
    result = {}
    for tier in ("premium", "standard"):
        mine = [o for o in outcomes if o.request.tier == tier]
        ttfts = [o.ttft_s for o in mine]
        result[tier] = {
            "requests": len(mine),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "goodput": sum(t <= slo[tier] for t in ttfts) / max(1, len(mine)),
            "preemptions": sum(o.preemptions for o in mine),
            # How well load() foresaw TTFT: the median of predicted / actual.
            "predicted_over_actual_p50": percentile([o.predicted_ttft_s / max(o.ttft_s, 1e-9) for o in mine], 50),
        }
    return result


def capacity_req_per_s(s: SimSettings, cost: CostModel) -> float:
    """Requests per second the machine completes when it never runs dry (FCFS, all at t=0)."""
    requests = workload(s, None)
    _, makespan = simulate(s, "fcfs", requests, cost)
    return len(requests) / makespan


def slo_scale(s: SimSettings, cost: CostModel) -> dict:
    """How much slower ``cost``'s machine serves this workload than the GPU coefficients' one."""
    if cost == CostModel():
        return {"factor": 1.0}
    sample = replace(s, num_requests=min(s.num_requests, 600))
    reference = capacity_req_per_s(sample, CostModel())
    return {"factor": reference / capacity_req_per_s(sample, cost), "reference_capacity_req_per_s": reference}


def run(s: SimSettings, cost: CostModel, loads: tuple[float, ...] = LOADS) -> dict:
    capacity = capacity_req_per_s(replace(s, num_requests=min(s.num_requests, 600)), cost)
    rows = []
    for load in loads:
        requests = workload(s, load * capacity)
        row = {"load": load, "rate_req_per_s": load * capacity}
        for policy in ("tiered", "fcfs"):
            outcomes, _ = simulate(s, policy, requests, cost)
            row[policy] = summarize(s, outcomes)
        rows.append(row)
    return {"settings": asdict(s), "cost_model": asdict(cost), "capacity_req_per_s": capacity,
            "rows": rows, "goals": goals(rows, s)}


def goals(rows: list[dict], s: SimSettings) -> list[dict]:
    by_load = {r["load"]: r for r in rows}
    out = []
    if 2.0 in by_load:
        t, f = by_load[2.0]["tiered"]["premium"], by_load[2.0]["fcfs"]["premium"]
        out.append({"goal": f"2x load: premium TTFT p99 within its {s.premium_slo_s:.3g} s SLO",
                    "value": t["ttft_p99_s"], "met": t["ttft_p99_s"] <= s.premium_slo_s})
        ratio = f["ttft_p99_s"] / max(t["ttft_p99_s"], 1e-9)
        out.append({"goal": "2x load: premium TTFT p99 at least 5x lower than fcfs", "value": ratio, "met": ratio >= 5})
    if 1.0 in by_load:
        t, f = by_load[1.0]["tiered"]["standard"], by_load[1.0]["fcfs"]["standard"]
        ratio = t["goodput"] / max(f["goodput"], 1e-9)
        out.append({"goal": "1x load: standard goodput at least 90% of fcfs's", "value": ratio, "met": ratio >= 0.9})
    return out


def print_table(result: dict) -> None:
    print(f"capacity {result['capacity_req_per_s']:.2f} req/s; SLO premium {result['settings']['premium_slo_s']:.3g} s, "
          f"standard yardstick {result['settings']['standard_slo_s']:.3g} s; cost {result['cost_model']}")
    scale = result.get("slo_scale")
    if scale and scale["factor"] != 1:
        print(f"SLOs scaled x{scale['factor']:.1f} from the GPU settings' {scale['reference_premium_slo_s']} s / "
              f"{scale['reference_standard_slo_s']} s: GPU coefficients' capacity "
              f"{scale['reference_capacity_req_per_s']:.2f} req/s over this cost model's "
              f"{result['capacity_req_per_s']:.3f} req/s")
    head = "{:>5} {:<9}|{:>8} {:>8} {:>5} {:>6} {:>5} |{:>8} {:>8} {:>5} {:>6} {:>5}"
    cols = ("p50 s", "p99 s", "good", "preem", "pred")
    print(f"{'':15}|{'tiered':^41}|{'fcfs':^41}")
    print(head.format("load", "tier", *cols, *cols))
    for row in result["rows"]:
        for tier in ("premium", "standard"):
            cells = []
            for policy in ("tiered", "fcfs"):
                m = row[policy][tier]
                cells += [f"{m['ttft_p50_s']:.3f}", f"{m['ttft_p99_s']:.3f}", f"{m['goodput']:.0%}",
                          m["preemptions"], f"{m['predicted_over_actual_p50']:.2f}"]
            print(head.format(f"{row['load']}x", tier, *cells))
    print("good: share of requests within the TTFT SLO; preem: preemptions of the tier's requests;")
    print("pred: median of load()'s predicted TTFT at arrival over the actual TTFT")
    for g in result["goals"]:
        print(f"[{'MET' if g['met'] else 'MISSED'}] {g['goal']}: {g['value']:.3g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--cost-model", help="JSON of fitted step-cost coefficients")
    p.add_argument("--requests", type=int, default=SimSettings.num_requests)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--premium-slo", type=float, default=SimSettings.premium_slo_s)
    p.add_argument("--standard-slo", type=float, default=SimSettings.standard_slo_s)
    p.add_argument("--num-blocks", type=int, default=SimSettings.num_blocks, help="KV pool, blocks of 16 tokens")
    p.add_argument("--slo-scale", default="auto",
                   help="multiply both SLOs by this; auto: GPU coefficients' capacity over the cost model's")
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error("--requests must be at least 10")
    try:
        fixed_scale = None if args.slo_scale == "auto" else float(args.slo_scale)
    except ValueError:
        p.error("--slo-scale wants 'auto' or a positive number")
    if fixed_scale is not None and fixed_scale <= 0:
        p.error("--slo-scale wants 'auto' or a positive number")
    try:
        cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    except (OSError, ValueError, TypeError) as exc:
        p.error(f"--cost-model {args.cost_model}: {exc}")
    settings = SimSettings(seed=args.seed, num_requests=args.requests, num_blocks=args.num_blocks,
                           premium_slo_s=args.premium_slo, standard_slo_s=args.standard_slo)
    scale = slo_scale(settings, cost) if fixed_scale is None else {"factor": fixed_scale}
    scaled = replace(settings, premium_slo_s=settings.premium_slo_s * scale["factor"],
                     standard_slo_s=settings.standard_slo_s * scale["factor"])
    result = run(scaled, cost)
    result["slo_scale"] = {**scale, "reference_premium_slo_s": settings.premium_slo_s,
                           "reference_standard_slo_s": settings.standard_slo_s}
    print_table(result)
    if args.json:
        report.write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
