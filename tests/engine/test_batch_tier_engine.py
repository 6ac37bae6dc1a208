"""The batch tier on the real engine (issue 32): batch and interactive requests run together, every one
gets its own greedy tokens, and only batch requests are ever preempted, their recompute billed to batch."""

from __future__ import annotations

import asyncio
import random
import time

from engine.events import FinishEvent, StepEvent
from engine.request import EngineRequest, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 300) for _ in range(n)]


def test_interactive_requests_preempt_batch_ones_and_are_never_preempted_themselves(make_engine, hf_greedy):
    # Four slots, all taken by batch lines when the interactive requests arrive: each needs one freed.
    engine, events = make_engine(max_num_seqs=4)
    rng = random.Random(7)
    batch = [EngineRequest(f"b{i}", _prompt(rng, 20), SamplingParams(max_tokens=40, **GREEDY), tier="batch",
                           tenant=f"bulk{i % 2}") for i in range(6)]
    interactive = [EngineRequest(f"i{i}", _prompt(rng, 12), SamplingParams(max_tokens=8, **GREEDY),
                                 tier=("premium", "standard")[i % 2], tenant="live") for i in range(3)]

    async def main() -> dict[str, list[int]]:
        busy = asyncio.Event()

        async def run(request: EngineRequest) -> tuple[str, list[int]]:
            ids: list[int] = []
            async for delta in engine.generate(request):
                ids.extend(delta.token_ids)
                if request.tier == "batch" and len(ids) >= 2:
                    busy.set()
            return request.request_id, ids

        tasks = [asyncio.create_task(run(r)) for r in batch]
        await busy.wait()  # batch lines hold every slot and decode
        tasks += [asyncio.create_task(run(r)) for r in interactive]
        return dict(await asyncio.gather(*tasks))

    outputs = asyncio.run(main())
    for request in batch + interactive:
        assert outputs[request.request_id] == hf_greedy(request.prompt_token_ids, request.params.max_tokens)
    steps = [e for e in events if isinstance(e, StepEvent)]
    preempted_tiers = [tier for e in steps for _, tier in e.preempted]
    assert preempted_tiers and set(preempted_tiers) == {"batch"}
    recompute = [item for e in steps for item in e.items if item.is_recompute]
    assert recompute and {item.charged_tier for item in recompute} == {"batch"}
    seconds = {}
    for e in steps:
        for item, s in e.seconds_by_item():
            seconds[item.charged_tier] = seconds.get(item.charged_tier, 0.0) + s
    assert seconds.keys() == {"premium", "standard", "batch"} and min(seconds.values()) > 0
    finished = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert {finished[r.request_id].tier for r in batch} == {"batch"}
    deadline = time.monotonic() + 5  # the engine thread frees the last blocks after the last delta
    while engine.scheduler.has_unfinished() or engine.scheduler.num_used_blocks:
        assert time.monotonic() < deadline, "blocks leaked"
        time.sleep(0.01)
