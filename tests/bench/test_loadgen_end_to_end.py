"""The load generator against a small in-test app that speaks the gateway's SSE and error shapes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from bench.load import loadgen
from bench.load.plan import Tenant
from bench.load.trace import TraceRecord, write_trace

KEYS = {"sk-premium": "premium", "sk-standard": "standard", "sk-limited": "standard"}


def fake_gateway() -> tuple[Starlette, dict]:
    seen = {"bodies": [], "preemptions": 0}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "smol", "object": "model"}]})

    async def completions(request: Request):
        key = request.headers["authorization"].removeprefix("Bearer ")
        if key == "sk-limited":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                           "code": "rpm"}}, status_code=429, headers={"Retry-After": "1"})
        body = await request.json()
        seen["bodies"].append(body)
        seen["preemptions"] += KEYS[key] == "standard"
        n = body["max_tokens"]

        async def events():
            for i in range(n):
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'finish_reason': None}]})}\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request: Request):
        return PlainTextResponse(
            "# HELP tiergate_preemptions_total Preemptions.\n# TYPE tiergate_preemptions_total counter\n"
            f'tiergate_preemptions_total{{tier="standard"}} {float(seen["preemptions"])}\n'
            'tiergate_preemptions_total{tier="premium"} 0.0\n'
        )

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                            Route("/metrics", metrics)])
    return app, seen


@pytest.fixture(scope="module")
def gateway():
    app, seen = fake_gateway()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=5)


def settings(url: str, **kw) -> loadgen.LoadSettings:
    tenants = [Tenant("p", "premium", "sk-premium"), Tenant("s", "standard", "sk-standard"),
               Tenant("l", "standard", "sk-limited")]
    defaults = dict(base_url=url, tenants=tenants, tier_share={"premium": 0.5, "standard": 0.5},
                    num_requests=24, prompt_len_range=(3, 8), output_len_range=(2, 6), progress=False)
    return loadgen.LoadSettings(**(defaults | kw))


def test_closed_loop_counts_every_request_tokens_and_429s(gateway):
    url, seen = gateway
    before = len(seen["bodies"])
    result = asyncio.run(loadgen.run_load(settings(url), concurrency=4))
    requests = result["requests"]
    assert len(requests) == 24
    tiers = result["tiers"]
    assert tiers["premium"]["requests"] + tiers["standard"]["requests"] == 24
    limited = sum(r["tenant"] == "l" for r in requests)
    assert tiers["standard"]["rejected_429"] == ({"rpm": limited} if limited else {})
    assert len(seen["bodies"]) - before == 24 - limited
    served = [r for r in requests if r["status"] == 200]
    assert all(r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"] for r in served)
    assert sum(r["output_tokens"] for r in served) == sum(b["max_tokens"] for b in seen["bodies"][before:])
    assert result["preemptions"]["standard"] == sum(r["tenant"] == "s" for r in requests)
    assert all(b["stream"] and b["model"] == "smol" for b in seen["bodies"][before:])


def test_trace_replay_sends_the_trace_in_order_at_its_times(gateway, tmp_path):
    url, seen = gateway
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [TraceRecord(0.0, "p", "french", 4, 3), TraceRecord(0.3, "s", None, 6, 2),
                        TraceRecord(0.15, "p", None, 5, 4)])
    before = len(seen["bodies"])
    result = asyncio.run(loadgen.run_load(settings(url, trace=trace)))
    bodies = seen["bodies"][before:]
    assert [(b["model"], b["max_tokens"]) for b in bodies] == [("french", 3), ("smol", 4), ("smol", 2)]
    starts = [r["started_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[2] >= 0.3
    assert [r["output_tokens"] for r in result["requests"]] == [3, 4, 2]


def test_command_line_sweep_writes_json_and_plots(gateway, tmp_path):
    url, _ = gateway
    out = tmp_path / "out.json"
    code = loadgen.main(["--url", url, "--key", "premium=sk-premium", "--key", "standard=sk-standard",
                         "--rate", "50,100", "--requests", "10", "--prompt-len", "3:5", "--output-len", "2:3",
                         "--slo", "premium=ttft:5,tpot:1", "--json", str(out), "--plots-dir", str(tmp_path),
                         "--no-progress"])
    assert code == 0
    points = json.loads(out.read_text())["points"]
    assert [p["offered"] for p in points] == [50.0, 100.0]
    assert all(sum(t["requests"] for t in p["tiers"].values()) == 10 for p in points)
    assert (tmp_path / "loadgen_open_latency.png").stat().st_size > 0
    assert (tmp_path / "loadgen_open_goodput.png").stat().st_size > 0


def test_a_sweeps_points_send_the_same_sizes_with_prompts_of_their_own(gateway):
    url, seen = gateway
    before = len(seen["bodies"])
    asyncio.run(loadgen.run_sweep(settings(url), rates=[200.0, 200.0]))
    bodies = seen["bodies"][before:]
    first, second = bodies[:len(bodies) // 2], bodies[len(bodies) // 2:]
    assert sorted(b["max_tokens"] for b in first) == sorted(b["max_tokens"] for b in second)
    assert not {b["prompt"] for b in first} & {b["prompt"] for b in second}


def test_command_line_refuses_bad_input_with_one_line(capsys):
    assert loadgen.main(["--key", "premium", "--rate", "1"]) == 2
    assert "TIER=KEY" in capsys.readouterr().err
