"""Load generator: streaming requests against a live tiergate gateway, results per tier.

Open loop (Poisson arrivals at each --rate), closed loop (each --concurrency
level), or a JSONL trace replayed at its own times. Tenants are API keys per
tier; adapters are drawn Zipf-popular; lengths are seeded or from the trace.
Writes JSON (per tier TTFT/TPOT/end-to-end percentiles, goodput, throughput,
429s by reason, preemptions from /metrics) and PNG plots against offered load.

    .venv/bin/python -m bench.load.loadgen --url http://127.0.0.1:8000 \\
        --key premium=sk-... --key standard=sk-... --share premium=0.2,standard=0.8 \\
        --slo premium=ttft:0.5,tpot:0.2 --rate 0.5,1,2 --requests 60 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.common import paths, report
from bench.load.aggregate import RequestResult, Slo, tier_report
from bench.load.arrivals import poisson_arrivals
from bench.load.client import scrape_counter, send
from bench.load.plan import PlannedRequest, PromptTexts, Tenant, synthetic_plan, trace_plan
from bench.load.plots import plot_sweep
from bench.load.trace import read_trace


@dataclass
class LoadSettings:
    base_url: str
    tenants: list[Tenant]
    tier_share: dict[str, float] = field(default_factory=lambda: {"premium": 0.2, "standard": 0.8})
    slos: dict[str, Slo] = field(default_factory=dict)
    num_requests: int = 50
    endpoint: str = "completions"  # or "chat"
    base_model: str | None = None  # None: the first model /v1/models lists
    adapters: list[str] = field(default_factory=list)
    adapter_fraction: float = 0.0
    zipf_exponent: float = 1.0
    prompt_len_range: tuple[int, int] = (20, 400)
    output_len_range: tuple[int, int] = (16, 256)
    trace: Path | None = None
    ignore_eos: bool = False
    tokenizer_dir: Path | None = None
    seed: int = 0
    prompt_offset: int = 0  # added to each request's index for its prompt text: runs of one seed, other prompts
    request_timeout_s: float = 600.0
    progress: bool = True


def _prompt_texts(settings: LoadSettings) -> PromptTexts:
    corpus = paths.PASSAGES.read_text()
    if settings.tokenizer_dir is None:
        return PromptTexts(corpus)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(settings.tokenizer_dir / "tokenizer.json"))
    return PromptTexts(corpus, lambda t: tok.encode(t, add_special_tokens=False).ids, tok.decode)


async def _base_model(client: httpx.AsyncClient, settings: LoadSettings) -> str:
    if settings.base_model:
        return settings.base_model
    response = await client.get(settings.base_url + "/v1/models",
                                headers={"Authorization": f"Bearer {settings.tenants[0].key}"})
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def make_plan(settings: LoadSettings, base_model: str, rate: float | None) -> list[PlannedRequest]:
    if settings.trace is not None:
        return trace_plan(read_trace(settings.trace), settings.tenants, base_model)
    times = poisson_arrivals(rate, settings.num_requests, settings.seed) if rate else None
    return synthetic_plan(
        settings.num_requests, settings.tenants, settings.tier_share, base_model, settings.adapters,
        settings.adapter_fraction, settings.zipf_exponent, settings.prompt_len_range,
        settings.output_len_range, times, settings.seed,
    )


async def run_load(settings: LoadSettings, rate: float | None = None, concurrency: int | None = None) -> dict:
    """One run: open loop at ``rate``, closed loop at ``concurrency``, or the trace's own times."""
    if (rate is None) == (concurrency is None) and settings.trace is None:
        raise ValueError("give exactly one of rate (open loop) and concurrency (closed loop)")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=settings.request_timeout_s, limits=limits) as client:
        base_model = await _base_model(client, settings)
        plan = make_plan(settings, base_model, rate)
        texts = _prompt_texts(settings)
        prompts = [texts.text(r.prompt_tokens, r.index + settings.prompt_offset) for r in plan]
        before = await scrape_counter(client, settings.base_url, "tiergate_preemptions_total")
        bar = tqdm(total=len(plan), disable=not settings.progress, desc=_label(settings, rate, concurrency), unit="req")
        start = time.perf_counter()

        async def one(r: PlannedRequest) -> RequestResult:
            result = await send(client, settings.base_url, r, prompts[r.index], settings.endpoint,
                                settings.ignore_eos, start)
            bar.update()
            return result

        if concurrency is not None and settings.trace is None:
            results = await _closed_loop(plan, concurrency, one)
        else:
            results = await _open_loop(plan, start, one)
        duration = time.perf_counter() - start
        bar.close()
        after = await scrape_counter(client, settings.base_url, "tiergate_preemptions_total")
    return {
        "mode": "trace" if settings.trace else ("open" if rate is not None else "closed"),
        "offered": rate if rate is not None else concurrency,
        "duration_s": duration,
        "tiers": tier_report(results, duration, settings.slos),
        "preemptions": {tier: after.get(tier, 0.0) - before.get(tier, 0.0) for tier in after},
        "requests": [asdict(r) for r in sorted(results, key=lambda r: r.index)],
    }


async def _open_loop(plan, start, one) -> list[RequestResult]:
    tasks = []
    for r in plan:
        delay = start + r.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(r)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(plan, concurrency, one) -> list[RequestResult]:
    queue = iter(plan)
    results: list[RequestResult] = []

    async def worker() -> None:
        for r in queue:  # a shared iterator: each request goes to exactly one worker
            results.append(await one(r))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _label(settings: LoadSettings, rate, concurrency) -> str:
    if settings.trace:
        return "trace"
    return f"rate {rate}/s" if rate is not None else f"concurrency {concurrency}"


async def run_sweep(settings: LoadSettings, rates: list[float] = (), concurrencies: list[int] = ()) -> list[dict]:
    """One run per rate, then per concurrency: the same seed (sizes, tiers, times), each point its own prompts, so no
    point is served from an earlier one's prefix cache."""
    loops = [{"rate": r} for r in rates] + [{"concurrency": c} for c in concurrencies]
    return [await run_load(point_settings(settings, i), **loop) for i, loop in enumerate(loops)]


def point_settings(settings: LoadSettings, point: int) -> LoadSettings:
    """``settings`` for the sweep's ``point``-th run: its prompts start past the earlier points'."""
    return replace(settings, prompt_offset=settings.prompt_offset + point * settings.num_requests)


# --- command line ---------------------------------------------------------

def _pairs(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected NAME=VALUE, got {part!r}")
        out[key.strip()] = value.strip()
    return out


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise ValueError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return lo_i, hi_i


def _slos(specs: list[str]) -> dict[str, Slo]:
    slos = {}
    for spec in specs:
        tier, _, bounds = spec.partition("=")
        values = {k: float(v) for k, v in (b.split(":") for b in bounds.split(",") if b)}
        unknown = values.keys() - {"ttft", "tpot"}
        if unknown:
            raise ValueError(f"unknown SLO bound(s) {sorted(unknown)}; use ttft and tpot")
        slos[tier] = Slo(values.get("ttft"), values.get("tpot"))
    return slos


def _tenants(args) -> list[Tenant]:
    tenants = []
    if args.tenants_file:
        raw = json.loads(Path(args.tenants_file).read_text())
        for t in raw["tenants"] if isinstance(raw, dict) else raw:
            tenants.append(Tenant(t["name"], t["tier"], t["key"]))
    for i, spec in enumerate(args.key):
        tier, _, key = spec.partition("=")
        if not key:
            raise ValueError(f"--key wants TIER=KEY, got {spec!r}")
        tenants.append(Tenant(f"{tier}-{i}", tier, key))
    if not tenants:
        raise ValueError("give tenant keys with --key TIER=KEY or --tenants-file")
    return tenants


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.load.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--key", action="append", default=[], help="TIER=API_KEY (repeat for more tenants)")
    p.add_argument("--tenants-file", help='JSON: {"tenants": [{"name", "tier", "key"}, ...]}')
    p.add_argument("--share", default="premium=0.2,standard=0.8", help="tier mix, TIER=SHARE,...")
    p.add_argument("--slo", action="append", default=[], help="TIER=ttft:SECONDS,tpot:SECONDS (repeatable)")
    p.add_argument("--rate", default="", help="open loop: comma-separated arrival rates (requests/s)")
    p.add_argument("--concurrency", default="", help="closed loop: comma-separated concurrency levels")
    p.add_argument("--trace", help="replay this JSONL trace at its own times")
    p.add_argument("--requests", type=int, default=50, help="requests per run")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="base model name (default: the first in /v1/models)")
    p.add_argument("--adapters", default="", help="adapter names, most popular first")
    p.add_argument("--adapter-fraction", type=float, default=0.0, help="share of requests that use an adapter")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    p.add_argument("--prompt-len", default="20:400", help="prompt tokens, LO:HI uniform")
    p.add_argument("--output-len", default="16:256", help="output tokens, LO:HI uniform")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exact output lengths (ignore_eos)")
    p.add_argument("--tokenizer", help="a model directory with tokenizer.json, for exact prompt lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plots-dir", help="write PNG plots here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> LoadSettings:
    return LoadSettings(
        base_url=args.url.rstrip("/"),
        tenants=_tenants(args),
        tier_share={k: float(v) for k, v in _pairs(args.share).items()},
        slos=_slos(args.slo),
        num_requests=args.requests,
        endpoint=args.endpoint,
        base_model=args.model,
        adapters=[a for a in args.adapters.split(",") if a],
        adapter_fraction=args.adapter_fraction,
        zipf_exponent=args.zipf,
        prompt_len_range=_range(args.prompt_len),
        output_len_range=_range(args.output_len),
        trace=Path(args.trace) if args.trace else None,
        ignore_eos=args.ignore_eos,
        tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None,
        seed=args.seed,
        progress=not args.no_progress,
    )


def _summary_line(point: dict) -> str:
    tiers = "; ".join(
        f"{tier}: {t['ok']}/{t['requests']} ok, 429 {t['rejected_429'] or '-'}, "
        f"TTFT p99 {t['ttft_s']['p99'] if t['ttft_s']['p99'] is None else round(t['ttft_s']['p99'], 3)} s, "
        f"goodput {t['goodput_fraction']:.0%}"
        for tier, t in point["tiers"].items()
    )
    return f"{point['mode']} {point['offered']}: {tiers}; preemptions {point['preemptions']}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        settings = settings_from_args(args)
        rates = [float(r) for r in args.rate.split(",") if r]
        concurrencies = [int(c) for c in args.concurrency.split(",") if c]
        if not (rates or concurrencies or settings.trace):
            raise ValueError("give --rate, --concurrency or --trace")
    except (ValueError, OSError, KeyError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    if settings.trace:
        points = [asyncio.run(run_load(settings))]
    else:
        points = asyncio.run(run_sweep(settings, rates, concurrencies))
    for p in points:
        print(_summary_line(p))
    if args.json:
        report.write_json({"points": points}, args.json)
    if args.plots_dir:
        by_mode: dict[str, list[dict]] = {}
        for p in points:
            by_mode.setdefault(p["mode"], []).append(p)
        for mode, pts in by_mode.items():
            label = {"open": "offered load (requests/s)", "closed": "concurrency", "trace": "trace"}[mode]
            for path in plot_sweep(pts, label, Path(args.plots_dir), f"loadgen_{mode}"):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
