"""The batch tier bench's parts: feature detection of the Files API, the completions driver's window and
retries, token rates between samples, the goal ratios and where a run's plot goes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bench.live.batch_driver import has_files_api, line_body, run_via_completions, tier_counters
from bench.live.batch_tier import OUT, engine_use, plot_path, pooled, ratios, tokens_between


def gateway_without_files_api(seen: list[dict], busy_first: int) -> Starlette:
    """Answers completions (the first ``busy_first`` with 429) and has no /v1/files route."""
    in_flight = {"now": 0, "most": 0}

    async def completions(request: Request) -> JSONResponse:
        seen.append(await request.json())
        if len(seen) <= busy_first:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"retry-after": "0"})
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        await asyncio.sleep(0.01)
        in_flight["now"] -= 1
        return JSONResponse({"choices": [{"text": "x"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.in_flight = in_flight
    return app


def test_lines_go_as_completions_when_the_server_has_no_files_api_within_the_window():
    seen: list[dict] = []
    app = gateway_without_files_api(seen, busy_first=2)
    bodies = [line_body("m", f"prompt {i}", 4) for i in range(20)]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert not await has_files_api(client, "http://t", "k")
            return await run_via_completions(client, "http://t", "k", bodies, window=3)

    outcome = asyncio.run(main())
    assert (outcome.via, outcome.ok, outcome.failed, outcome.retried) == ("completions", 20, 0, 2)
    assert sorted(b["prompt"] for b in seen[2:]) == sorted(b["prompt"] for b in bodies)
    assert app.state.in_flight["most"] <= 3


def test_token_rates_and_ratios_from_samples():
    samples = [(0.0, {"premium": 0, "batch": 0}), (10.0, {"premium": 100, "batch": 0}),
               (20.0, {"premium": 200, "batch": 300}), (30.0, {"premium": 200, "batch": 900})]
    assert tokens_between(samples, 0, 10) == 10.0
    assert tokens_between(samples, 10, 20) == 40.0
    assert tokens_between(samples, 20, 30, ("batch",)) == 60.0
    result = {
        "alone": {"tiers": {"premium": {"ttft_s": {"p99": 0.5}}, "standard": {"ttft_s": {"p99": 1.0}}}},
        "beside": {"tiers": {"premium": {"ttft_s": {"p99": 0.55}}, "standard": {"ttft_s": {"p99": 0.9}}}},
        "tokens_per_s": {"alone": 10.0, "beside": 40.0, "batch_tail": 60.0, "capacity": 50.0},
        "marks": {"beside_end": 20.0, "batch_end": 30.0},
    }
    got = ratios(result)
    assert abs(got["ttft_p99_premium"] - 1.1) < 1e-9 and abs(got["ttft_p99_standard"] - 0.9) < 1e-9
    assert (got["engine_tokens"], got["batch_tail_vs_capacity"], got["batch_outlived_load"]) == (4.0, 1.2, True)


def test_the_metrics_page_gives_each_tiers_completion_tokens_and_engine_seconds():
    page = "\n".join([
        "# TYPE tiergate_tokens counter",
        'tiergate_tokens_total{kind="prompt",tier="premium"} 70.0',
        'tiergate_tokens_total{kind="completion",tier="premium"} 12.0',
        'tiergate_tokens_total{kind="completion",tier="batch"} 30.0',
        "# TYPE tiergate_gpu_seconds counter",
        'tiergate_gpu_seconds_total{tier="premium"} 0.25',
        'tiergate_gpu_seconds_total{tier="batch"} 1.5',
        "",
    ])
    assert tier_counters(page) == {"completion": {"premium": 12.0, "batch": 30.0}, "cached": {},
                                   "engine_s": {"premium": 0.25, "batch": 1.5}}


def test_engine_use_is_its_busy_share_and_milliseconds_per_token_of_each_side():
    tokens = [(0.0, {"premium": 0, "standard": 0, "batch": 0}), (10.0, {"premium": 100, "standard": 100, "batch": 0}),
              (20.0, {"premium": 200, "standard": 200, "batch": 250})]
    engine_s = [(0.0, {"premium": 0.0, "standard": 0.0, "batch": 0.0}),
                (10.0, {"premium": 0.3, "standard": 0.5, "batch": 0.0}),
                (20.0, {"premium": 1.3, "standard": 1.5, "batch": 7.0})]
    cached = [(0.0, {"premium": 0}), (10.0, {"premium": 50}), (20.0, {"premium": 50})]
    counters = {"engine_s": engine_s, "cached": cached}
    alone = engine_use(tokens, counters, 0, 10)
    assert abs(alone["busy"] - 0.08) < 1e-9 and abs(alone["ms_per_token_interactive"] - 4.0) < 1e-9
    assert alone["ms_per_token_batch"] is None and alone["cached_prompt_tokens_interactive"] == 50
    beside = engine_use(tokens, counters, 10, 20)
    assert abs(beside["busy"] - 0.9) < 1e-9 and abs(beside["ms_per_token_interactive"] - 10.0) < 1e-9
    assert abs(beside["ms_per_token_batch"] - 28.0) < 1e-9 and beside["cached_prompt_tokens_interactive"] == 0


def test_alone_pools_the_runs_before_and_after_the_batch():
    def run(ttfts: list[float], duration_s: float) -> dict:
        return {"duration_s": duration_s, "requests": [
            {"index": i, "tier": "premium", "tenant": "acme", "model": "m", "prompt_tokens": 9, "started_s": 0.0,
             "status": 200, "ttft_s": t, "e2e_s": t + 1, "output_tokens": 4} for i, t in enumerate(ttfts)]}

    both = pooled(run([0.1] * 50, 10.0), run([0.3] * 50, 10.0))["tiers"]["premium"]
    assert both["requests"] == 100 and both["ttft_s"]["p50"] == pytest.approx(0.2) and both["ttft_s"]["p99"] == 0.3
    assert both["throughput_rps"] == 5.0


def test_a_run_with_a_json_names_its_plot_after_it_so_earlier_plots_stay():
    assert plot_path(Path("bench/out/batch_tier_zen4.json")) == OUT / "batch_tier_zen4_tokens_by_tier.png"
    assert plot_path(Path("/tmp/run2.json")) == OUT / "run2_tokens_by_tier.png"
    assert plot_path(None) == OUT / "tokens_by_tier.png"
