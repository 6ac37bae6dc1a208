"""The batch tier (issue 32) through the real gateway: interactive load alone, then beside a 2,000-line batch.

One `tiergate serve` (bundled model, this CPU, a throwaway SQLite database) with three tenants:
"acme" (premium), "globex" (standard) and "bulk" (batch). In one run:

1. capacity: the interactive mix in a closed loop at ``--capacity-concurrency``; completed requests/s.
2. alone: that mix as Poisson arrivals at ``--load`` times the capacity for ``--phase-s`` seconds.
3. beside: the same arrivals (same seed) with a ``--lines``-line batch started just before them;
   the batch then runs on after the interactive load ends, until it is done.
4. after: the load alone again. "Alone" in the ratios is phases 2 and 4 together: the machine's speed
   drifts over minutes, and two runs around the batch weigh that drift on both sides.

Each phase sends its own prompts (same sizes and times, other text), so none is served from another's
prefix cache.

The batch goes through OpenAI's Files and Batches API when the server has it (a 404 on ``POST
/v1/files`` means not yet), else each line is a /v1/completions request of the batch tenant, a
window of ``--window`` in flight (bench/live/batch_driver.py); the result says which. Completion tokens,
cached prompt tokens and engine seconds per tier are sampled from /metrics every ``--sample-s``: the plot,
and each phase's engine busy share and engine milliseconds per output token.

Goals (issue 32): interactive TTFT p99 beside the batch <= 1.1x alone, premium and standard each;
the engine's output tokens/s beside the batch >= 1.5x the interactive load's alone; the batch's
tail (after the interactive load ends) at the engine's full speed (its tokens/s against the
capacity run's).

    .venv/bin/python -m bench.live.batch_tier [--phase-s 120] [--lines 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import machine, model_files, paths, report
from bench.live.batch_driver import (
    BatchOutcome, Samples, has_files_api, line_body, run_via_completions, run_via_files_api, sample_tokens,
)
from bench.live.server import free_port, set_up_tenants, start_server, stop_server
from bench.load.aggregate import RequestResult, tier_report
from bench.load.loadgen import LoadSettings, _prompt_texts, run_load
from bench.load.plan import PromptTexts, Tenant

OUT = paths.OUT / "batch_tier"
TENANTS = (("acme", "premium"), ("globex", "standard"), ("bulk", "batch"))
LIMITS = ["--rpm", "1000000", "--tpm", "1000000000", "--max-concurrent", "10000"]
INTERACTIVE = ("premium", "standard")
# Completion tokens are counted when a request ends, so the plot's rates are taken over this window.
PLOT_WINDOW_S = 10.0


# Each phase's prompts start at its own index, the batch's lines at BATCH_PROMPTS: the phases share their
# arrivals and sizes (one seed), never a prompt, so no phase is served from another's prefix cache.
PHASE_PROMPTS = {"warm_up": 50_000, "capacity": 60_000, "alone": 0, "beside": 10_000, "after": 20_000}
BATCH_PROMPTS = 100_000


def interactive_settings(args: argparse.Namespace, url: str, tenants: list[Tenant], requests: int,
                         phase: str = "alone") -> LoadSettings:
    return LoadSettings(
        base_url=url, tenants=[t for t in tenants if t.tier in INTERACTIVE], num_requests=requests,
        tier_share={"premium": args.premium_share, "standard": 1 - args.premium_share},
        prompt_len_range=(20, args.max_prompt), output_len_range=(16, args.max_output), ignore_eos=True,
        tokenizer_dir=model_files.hf_dir(), seed=args.seed, prompt_offset=PHASE_PROMPTS[phase], progress=False)


def batch_bodies(args: argparse.Namespace, texts: PromptTexts, model: str) -> list[dict]:
    return [line_body(model, texts.text(20 + (i * 37) % (args.line_prompt - 19), BATCH_PROMPTS + i), args.line_tokens)
            for i in range(args.lines)]


async def run_batch(client: httpx.AsyncClient, url: str, key: str, bodies: list[dict], window: int) -> BatchOutcome:
    if await has_files_api(client, url, key):
        return await run_via_files_api(client, url, key, bodies)
    return await run_via_completions(client, url, key, bodies, window)


def ttft_p99(point: dict, tier: str) -> float | None:
    return (point["tiers"].get(tier) or {}).get("ttft_s", {}).get("p99")


def gained_between(samples: Samples, start: float, end: float, tiers: tuple[str, ...] | None = None
                   ) -> tuple[float, float]:
    """What the per-tier counter ``samples`` holds (completion tokens, engine seconds, ...) gained between the samples
    nearest ``start`` and ``end``, summed over ``tiers`` (every tier if None), and the seconds between those samples."""
    first = min(samples, key=lambda s: abs(s[0] - start))
    last = min(samples, key=lambda s: abs(s[0] - end))
    if last[0] <= first[0]:
        return 0.0, 0.0
    keys = tiers if tiers is not None else set(first[1]) | set(last[1])
    return sum(last[1].get(t, 0.0) - first[1].get(t, 0.0) for t in keys), last[0] - first[0]


def tokens_between(samples: Samples, start: float, end: float, tiers: tuple[str, ...] | None = None) -> float:
    """Completion tokens per second counted between the samples nearest ``start`` and ``end`` (or whatever
    per-tier counter ``samples`` holds: the engine seconds too)."""
    gained, seconds = gained_between(samples, start, end, tiers)
    return gained / seconds if seconds else 0.0


def engine_use(samples: Samples, counters: dict[str, Samples], start: float, end: float) -> dict:
    """Between ``start`` and ``end``: the share of the time the engine ran steps (its metered seconds, every tier),
    its milliseconds per output token for the interactive tiers and the batch (None without tokens), and the
    interactive prompt tokens served from the prefix cache."""
    def per_token(tiers: tuple[str, ...]) -> float | None:
        tokens = tokens_between(samples, start, end, tiers)
        return 1000 * tokens_between(counters["engine_s"], start, end, tiers) / tokens if tokens else None

    return {"busy": tokens_between(counters["engine_s"], start, end),
            "ms_per_token_interactive": per_token(INTERACTIVE), "ms_per_token_batch": per_token(("batch",)),
            "cached_prompt_tokens_interactive": gained_between(counters["cached"], start, end, INTERACTIVE)[0]}


def pooled(*points: dict) -> dict:
    """The per-tier report over the requests of several load runs, as one run of their summed durations."""
    results = [RequestResult(**r) for point in points for r in point["requests"]]
    return {"tiers": tier_report(results, sum(p["duration_s"] for p in points), {})}


async def measure(args: argparse.Namespace, url: str, tenants: list[Tenant]) -> dict:
    bulk = next(t for t in tenants if t.tier == "batch")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        origin = time.perf_counter()
        samples: Samples = []
        counters: dict[str, Samples] = {"engine_s": [], "cached": []}  # read with the tokens
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_tokens(client, url, args.sample_s, origin, samples, stop, counters))
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            marks[name] = time.perf_counter() - origin
            print(f"batch_tier: {name} at {marks[name]:.0f} s", file=sys.stderr, flush=True)

        def load(phase: str, requests: int) -> LoadSettings:
            return interactive_settings(args, url, tenants, requests, phase)

        await run_load(load("warm_up", 4), concurrency=2)
        mark("capacity_start")
        capacity = await run_load(load("capacity", args.capacity_requests), concurrency=args.capacity_concurrency)
        mark("capacity_end")
        capacity_rps = sum(t["throughput_rps"] or 0 for t in capacity["tiers"].values())
        rate = args.load * capacity_rps
        requests = max(4, round(rate * args.phase_s))
        alone = await run_load(load("alone", requests), rate=rate)
        mark("alone_end")
        await asyncio.sleep(args.settle_s)  # the alone phase's last streams end before the batch starts
        texts = _prompt_texts(load("alone", 1))
        bodies = batch_bodies(args, texts, alone["requests"][0]["model"])
        mark("batch_start")
        batch_task = asyncio.create_task(run_batch(client, url, bulk.key, bodies, args.window))
        await asyncio.sleep(args.batch_lead_s)  # the batch fills the engine before the interactive load comes
        mark("beside_start")
        beside = await run_load(load("beside", requests), rate=rate)
        mark("beside_end")
        batch = await batch_task
        marks["batch_end"] = batch.finished_at - origin
        await asyncio.sleep(args.settle_s)
        # The load alone again, after the batch: "alone" is both runs, so a drift of the machine's speed over the
        # run weighs on both sides of the ratios.
        mark("after_start")
        after = await run_load(load("after", requests), rate=rate)
        mark("after_end")
        stop.set()
        await sampler
    spans = {"capacity": (marks["capacity_start"], marks["capacity_end"]),
             "alone": (marks["capacity_end"], marks["alone_end"]),
             "beside": (marks["beside_start"], marks["beside_end"]),
             "after": (marks["after_start"], marks["after_end"])}
    rate_in = {name: tokens_between(samples, *span) for name, span in spans.items()}
    (alone_tokens, alone_s), (after_tokens, after_s) = (gained_between(samples, *spans[n]) for n in ("alone", "after"))
    return {
        "capacity": capacity, "alone_before": alone, "alone_after": after, "alone": pooled(alone, after),
        "beside": beside, "rate_rps": rate, "capacity_rps": capacity_rps,
        "batch": vars(batch), "marks": marks, "samples": samples, "counter_samples": counters,
        "engine": {name: engine_use(samples, counters, *span) for name, span in spans.items()},
        "tokens_per_s": {
            "capacity": rate_in["capacity"],
            "alone_before": rate_in["alone"], "alone_after": rate_in["after"],
            "alone": (alone_tokens + after_tokens) / (alone_s + after_s),
            "beside": rate_in["beside"],
            "beside_interactive": tokens_between(samples, *spans["beside"], INTERACTIVE),
            "beside_batch": tokens_between(samples, *spans["beside"], ("batch",)),
            "batch_tail": tokens_between(samples, marks["beside_end"], marks["batch_end"], ("batch",)),
        },
    }


def ratios(result: dict) -> dict:
    tps = result["tokens_per_s"]
    out = {f"ttft_p99_{tier}": _ratio(ttft_p99(result["beside"], tier), ttft_p99(result["alone"], tier))
           for tier in INTERACTIVE}
    out["engine_tokens"] = _ratio(tps["beside"], tps["alone"])
    out["batch_tail_vs_capacity"] = _ratio(tps["batch_tail"], tps["capacity"])
    out["batch_outlived_load"] = result["marks"]["batch_end"] > result["marks"]["beside_end"]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    samples, marks = result["samples"], result["marks"]
    tiers = ["premium", "standard", "batch"]
    k = max(1, round(PLOT_WINDOW_S / result["settings"]["sample_s"]))
    pairs = list(zip(samples, samples[k:]))
    times = [(a[0] + b[0]) / 2 for a, b in pairs]
    rates = {t: [(b[1].get(t, 0) - a[1].get(t, 0)) / max(b[0] - a[0], 1e-9) for a, b in pairs] for t in tiers}
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.stackplot(times, *(rates[t] for t in tiers), labels=tiers, alpha=0.8)
    for name in ("capacity_end", "alone_end", "beside_start", "beside_end", "batch_end", "after_start"):
        ax.axvline(marks[name], color="k", lw=0.6, ls="--")
        ax.text(marks[name], ax.get_ylim()[1] * 0.97, name.replace("_", " "), rotation=90, va="top", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"completion tokens/s ({PLOT_WINDOW_S:g} s window)")
    ax.set_title("Output tokens/s by tier: capacity, interactive alone, beside a batch, the batch's tail, alone again")
    ax.legend(loc="upper center")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict:
    host = machine.describe()
    with tempfile.TemporaryDirectory(prefix="tiergate-batch-tier-") as tmp:
        env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp}/tiergate.db",
               "TIERGATE_SPOOL_PATH": f"{tmp}/spool.jsonl", "TIERGATE_LOG_LEVEL": "warning"}
        tenants = set_up_tenants(env, TENANTS, LIMITS)
        port = free_port()
        server = start_server(env, "tiered", port, args.premium_ttft_slo)
        try:
            result = asyncio.run(measure(args, f"http://127.0.0.1:{port}", tenants))
        finally:
            stop_server(server)
    result["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["machine"] = host
    result["load_average_end"] = os.getloadavg()
    result["ratios"] = ratios(result)
    result["plots"] = [str(plot(result, plot_path(args.json)).relative_to(paths.ROOT))]
    for phase in ("capacity", "alone_before", "alone_after", "beside"):
        result[phase].pop("requests", None)
    return result


def plot_path(json_path: Path | None) -> Path:
    """Where a run's plot goes: named after its JSON where it has one, so that a run does not overwrite the plot
    an earlier result embeds."""
    return OUT / (f"{json_path.stem}_tokens_by_tier.png" if json_path is not None else "tokens_by_tier.png")


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(result: dict) -> str:
    s, r, tps, batch = result["settings"], result["ratios"], result["tokens_per_s"], result["batch"]
    lines = [
        f"Measured {machine.render_markdown(result['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in result['load_average_end'])}.",
        "",
        f"Interactive mix: premium {s['premium_share']:.0%} / standard, prompts 20:{s['max_prompt']} tokens, outputs "
        f"16:{s['max_output']}, greedy, EOS ignored. Capacity (closed loop, concurrency {s['capacity_concurrency']}): "
        f"{result['capacity_rps']:.2f} requests/s, {tps['capacity']:.0f} output tokens/s; load "
        f"{s['load']:.0%} of it = {result['rate_rps']:.2f} requests/s for {s['phase_s']} s per phase. Batch: "
        f"{batch['lines']} lines of {s['line_tokens']} tokens (prompts 20:{s['line_prompt']}), sent via "
        f"**{batch['via']}**" + (f" (window {s['window']})" if batch["via"] == "completions" else "")
        + f"; {batch['ok']} ok, {batch['failed']} failed, {batch['retried']} retried.",
        "",
        "The load alone ran twice, before the batch and after it; \"alone\" is both runs' requests.",
        "",
        "| tier | TTFT p50 alone | p50 beside | TTFT p99 alone (before / after) | p99 beside | p99 ratio (goal <= 1.1) "
        "| 429s alone / beside |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for tier in INTERACTIVE:
        a, b = result["alone"]["tiers"].get(tier, {}), result["beside"]["tiers"].get(tier, {})
        lines.append(f"| {tier} | {_f(a.get('ttft_s', {}).get('p50'))} | {_f(b.get('ttft_s', {}).get('p50'))} | "
                     f"{_f(ttft_p99(result['alone'], tier))} ({_f(ttft_p99(result['alone_before'], tier))} / "
                     f"{_f(ttft_p99(result['alone_after'], tier))}) | {_f(ttft_p99(result['beside'], tier))} | "
                     f"{_f(r[f'ttft_p99_{tier}'])} | {sum((a.get('rejected_429') or {}).values())} / "
                     f"{sum((b.get('rejected_429') or {}).values())} |")
    m = result["marks"]
    lines += [
        "",
        f"Engine output tokens/s: interactive alone {tps['alone']:.0f} (before {tps['alone_before']:.0f}, after "
        f"{tps['alone_after']:.0f}); beside the batch {tps['beside']:.0f} "
        f"(interactive {tps['beside_interactive']:.0f} + batch {tps['beside_batch']:.0f}): ratio "
        f"**{_f(r['engine_tokens'])}x** (goal >= 1.5). The batch ended {m['batch_end'] - m['beside_end']:.0f} s after "
        f"the interactive load did (outlived it: {r['batch_outlived_load']}), its tail at {tps['batch_tail']:.0f} tokens/s "
        f"= **{_f(r['batch_tail_vs_capacity'])}x** the capacity run's output rate.",
        "",
        "| phase | engine busy | engine ms per interactive token | per batch token | interactive prompt tokens "
        "from the prefix cache |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, use in result["engine"].items():
        lines.append(f"| {name} | {use['busy']:.0%} | {_f(use['ms_per_token_interactive'], '.1f')} | "
                     f"{_f(use['ms_per_token_batch'], '.1f')} | {use['cached_prompt_tokens_interactive']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.live.batch_tier", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=120.0, help="seconds of interactive load per phase")
    p.add_argument("--load", type=float, default=0.7, help="interactive load as a share of the measured capacity")
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--capacity-requests", type=int, default=96,
                   help="requests of the closed-loop capacity run that sets the load (about 20 s here)")
    p.add_argument("--premium-share", type=float, default=0.3)
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--line-tokens", type=int, default=16)
    p.add_argument("--line-prompt", type=int, default=120)
    p.add_argument("--window", type=int, default=16, help="batch lines in flight (completions path)")
    p.add_argument("--batch-lead-s", type=float, default=5.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--premium-ttft-slo", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    report.finish(result, args.json, render_markdown, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
