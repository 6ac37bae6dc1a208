"""Issue 31's defect 12 on the real engine: a neighbour's stream beside 1,987-token prompts, the bound off and on.

One engine on the bundled model, in process (no HTTP: what is measured is the scheduler's step
sizes on this CPU). A premium neighbour streams one request after another (a ~30-token prompt, 48
tokens out); another tenant sends a 1,987-token prompt every few seconds. The inter-token latency
bound (scheduler/step_budget.py) is switched between rounds on the same engine, so that every mode
sees the same machine and the same fitted step cost: "off" is the scheduler before the bound,
"seconds" the bound in seconds alone (premium TPOT 0.1 s, every step 0.15 s: the defaults before
``step_bound_factor``), "streams" those and no step beside a stream longer than three times its
decodes alone (the defaults before ``max_prefill_step_s``), "on" the gateway's CPU defaults (those,
and a step with nobody decoding at most 0.5 s). Each round also measures the neighbour alone first,
its baseline. Reported: the neighbour's TTFT and each gap between two of its deltas, the long
prompts' TTFT, and the tokens the engine computed per second (prompts and outputs).

With ``--neighbour-every-s`` the neighbour starts a request that often instead of one after another
(the hostile bench's neighbour: one a second), so that steps with nobody decoding come between its
requests, and a request of its arrives inside one of them.

    .venv/bin/python -m bench.offline.long_prompts [--rounds 2] [--round-s 20] [--modes off,seconds,streams,on]
        [--neighbour-every-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterator

from bench.common import machine, paths, report
from bench.common.stats import percentile
from bench.sim.long_prompts import gateway_defaults
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import EngineRequest, SamplingParams

LONG_PROMPT = 1987  # issue 31's
ON = {k: v for k, v in gateway_defaults("cpu").items() if k != "premium_slo_s"}  # the gateway's CPU bound
MODES = ("off", "seconds", "streams", "on")
NEIGHBOUR_TOKENS = 48
LONG_TOKENS = 8
_ids = itertools.count()


def _bound(engine: Engine, mode: str) -> None:
    """Switch the scheduler's bound between steps (its config is read afresh by every plan): ``mode`` one of MODES."""
    on = mode != "off"
    config = engine.scheduler.config
    tiers = tuple(dataclasses.replace(t, tpot_slo_s=ON["premium_tpot_slo_s"] if on and t.name == "premium" else None)
                  for t in config.tiers)
    engine.scheduler.config = dataclasses.replace(
        config, max_step_s=ON["max_step_s"] if on else None, tiers=tiers,
        step_bound_factor=ON["step_bound_factor"] if mode in ("streams", "on") else None,
        max_prefill_step_s=ON["max_prefill_step_s"] if mode == "on" else None)


async def _one(engine: Engine, prompt: list[int], max_tokens: int, tier: str, tenant: str) -> tuple[float, list[float]]:
    """(TTFT, gaps between deltas) of one greedy request."""
    request = EngineRequest(f"{tenant}-{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True), tier=tier, tenant=tenant)
    started = time.perf_counter()
    times = []
    async for delta in engine.generate(request):
        if delta.error:
            raise RuntimeError(delta.error)
        if delta.token_ids:
            times.append(time.perf_counter())
    return times[0] - started, [b - a for a, b in zip(times, times[1:])]


async def _phase(engine: Engine, prompts: dict, seconds: float, long_every_s: float | None,
                 neighbour_every_s: float | None = None) -> dict:
    """The neighbour streaming for ``seconds`` (a request every ``neighbour_every_s``; None: one after another),
    and a long prompt every ``long_every_s`` (None: none)."""
    neighbour = {"ttft": [], "gaps": [], "tokens": 0}
    long_ttft: list[float] = []
    deadline = time.perf_counter() + seconds

    async def stream() -> None:
        n = 0
        while time.perf_counter() < deadline:
            prompt = prompts["short"][n % len(prompts["short"])]
            started = time.perf_counter()
            ttft, gaps = await _one(engine, prompt, NEIGHBOUR_TOKENS, "premium", "neighbour")
            if neighbour_every_s is not None:
                await asyncio.sleep(max(0.0, started + neighbour_every_s - time.perf_counter()))
            neighbour["ttft"].append(ttft)
            neighbour["tokens"] += len(prompt) + NEIGHBOUR_TOKENS
            neighbour["gaps"] += gaps
            n += 1

    async def flood() -> None:
        tasks, n = [], 0
        while long_every_s is not None and time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(_one(engine, next(prompts["long"]), LONG_TOKENS, "standard", "long")))
            n += 1
            await asyncio.sleep(long_every_s)
        for ttft, _ in await asyncio.gather(*tasks):
            long_ttft.append(ttft)

    busy0, started = engine._loop.busy_seconds, time.perf_counter()
    await asyncio.gather(stream(), flood())
    return {"neighbour_ttft_s": neighbour["ttft"], "neighbour_gaps_s": neighbour["gaps"], "long_ttft_s": long_ttft,
            "tokens": neighbour["tokens"] + len(long_ttft) * (LONG_PROMPT + LONG_TOKENS),
            "wall_s": time.perf_counter() - started, "busy_s": engine._loop.busy_seconds - busy0}


def _prompts(engine: Engine) -> dict:
    short = [engine.tokenizer.encode(f"Question {i}: what happened at the harbour at dawn?") for i in range(16)]
    return {"long": _long_prompts(engine), "short": short}


def _long_prompts(engine: Engine) -> Iterator[list[int]]:
    """A new prompt for every request of the run, each its own from its first block: the prefix cache serves
    none of them (a prompt repeated in a later phase would be served from it, and skip the prefill measured)."""
    words = engine.tokenizer.encode(" ".join([paths.PASSAGES.read_text()] * 20))
    for i in itertools.count():
        head = engine.tokenizer.encode(f"Request {i}: summarise. ")
        yield head + words[:LONG_PROMPT - len(head)]


def _summary(runs: list[dict]) -> dict:
    gaps = [g for r in runs for g in r["neighbour_gaps_s"]]
    ttft = [t for r in runs for t in r["neighbour_ttft_s"]]
    long = [t for r in runs for t in r["long_ttft_s"]]
    return {"neighbour_ttft_p50_s": percentile(ttft, 50), "neighbour_ttft_p99_s": percentile(ttft, 99),
            "neighbour_gap_p50_s": percentile(gaps, 50), "neighbour_gap_p99_s": percentile(gaps, 99),
            "neighbour_gap_max_s": max(gaps, default=None), "long_ttft_p50_s": percentile(long, 50),
            "long_prompts": len(long), "neighbour_requests": len(ttft), "gaps": len(gaps),
            "busy_share": statistics.mean(r["busy_s"] / r["wall_s"] for r in runs),
            "tokens_per_s": sum(r.get("tokens", 0) for r in runs) / sum(r["wall_s"] for r in runs)}


async def _run(args: argparse.Namespace) -> dict:
    host = machine.describe()
    engine = Engine(EngineConfig(model="bundled", max_loras=0)).start()
    try:
        prompts = _prompts(engine)
        await _phase(engine, prompts, 6, 3)  # warm-up: thread trials and the step cost fit
        modes = args.modes.split(",")
        runs: dict[str, list[dict]] = {"alone": [], **{mode: [] for mode in modes}}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                _bound(engine, mode)
                runs["alone"].append(await _phase(engine, prompts, args.alone_s, None, args.neighbour_every_s))
                runs[mode].append(await _phase(engine, prompts, args.round_s, args.long_every_s, args.neighbour_every_s))
        return {"machine": host, "settings": {**vars(args), "long_prompt_tokens": LONG_PROMPT, "bound": ON},
                "step_cost_fit": dataclasses.asdict(engine.scheduler.step_cost.coefficients()),
                "summary": {mode: _summary(rs) for mode, rs in runs.items()}}
    finally:
        engine.shutdown()


def render_markdown(result: dict) -> str:
    s = result["settings"]

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    lines = [f"{s['rounds']} rounds, alternating which mode goes first; each: the neighbour alone {s['alone_s']:g} s, "
             f"then {s['round_s']:g} s with a {s['long_prompt_tokens']}-token prompt every {s['long_every_s']:g} s. "
             f"Bound on: {s['bound']}. Step cost fitted by the engine at the end: {result['step_cost_fit']}.", "",
             "| mode | neighbour TTFT p50 / p99 (ms) | neighbour gap p50 / p99 / max (ms) | long prompt TTFT p50 (s) "
             "| long prompts | tokens/s | engine busy |", "|---|---|---|---:|---:|---:|---:|"]
    for mode, m in result["summary"].items():
        long = "-" if m["long_ttft_p50_s"] is None else f"{m['long_ttft_p50_s']:.2f}"
        lines.append(f"| {mode} | {ms(m['neighbour_ttft_p50_s'])} / {ms(m['neighbour_ttft_p99_s'])} "
                     f"| {ms(m['neighbour_gap_p50_s'])} / {ms(m['neighbour_gap_p99_s'])} / {ms(m['neighbour_gap_max_s'])} "
                     f"| {long} | {m['long_prompts']} | {m.get('tokens_per_s', 0):.0f} | {m['busy_share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--round-s", type=float, default=20.0)
    p.add_argument("--alone-s", type=float, default=6.0)
    p.add_argument("--long-every-s", type=float, default=4.0)
    p.add_argument("--neighbour-every-s", type=float, default=None,
                   help="the neighbour starts a request this often (default: one after another)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run, in this order")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if not args.modes or not set(args.modes.split(",")) <= set(MODES):
        p.error(f"--modes takes some of {', '.join(MODES)}")
    durations = [args.round_s, args.alone_s, args.long_every_s]
    if args.neighbour_every_s is not None:
        durations.append(args.neighbour_every_s)
    if args.rounds < 1 or min(durations) <= 0:
        p.error("--rounds must be at least 1 and the durations positive")
    result = asyncio.run(_run(args))
    report.finish(result, args.json, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
