"""The inter-token latency bound on a live engine: a long prompt arriving beside a decoding neighbour.

The long prompt is handed to the engine as soon as a plan shows the neighbour decoding (from inside
``Scheduler.schedule``, on the engine thread), so the order is deterministic whatever the machine's
speed. What is checked is the plans and step events, never a clock: the step cost model the
scheduler plans with is read as each plan is made.
"""

from __future__ import annotations

import random

from engine.events import StepEvent
from engine.request import EngineRequest, SamplingParams
from engine.stream import BlockingCollector
from scheduler.step_budget import step_target_s
from scheduler.step_cost import predict, step_features

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4  # the make_engine fixture's block size: the chunk a bounded step still takes


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(length)]


def _run(engine, neighbour: EngineRequest, long: EngineRequest):
    """Run ``neighbour``, send ``long`` once the neighbour decodes; (token ids by request, plans with the
    coefficients each was planned with)."""
    collectors = {r.request_id: BlockingCollector() for r in (neighbour, long)}
    schedule, planned, sent = engine.scheduler.schedule, [], []

    def schedule_and_record():
        cost = engine.scheduler.step_cost.coefficients()
        decoding = [s for s in engine.scheduler.running if not s.is_prefilling]
        plan = schedule()
        planned.append((plan, cost, step_target_s(engine.scheduler.config, decoding)))
        if not sent and step_features(plan).decode_rows:
            sent.append(True)
            engine._accept_request(long, collectors[long.request_id].push)
        return plan

    engine.scheduler.schedule = schedule_and_record
    engine._accept_request(neighbour, collectors[neighbour.request_id].push)
    tokens = {}
    for rid, collector in collectors.items():
        ids = []
        for delta in collector:
            assert delta.error is None, delta.error
            ids.extend(delta.token_ids)
        tokens[rid] = ids
    return tokens, planned


def test_a_long_prompt_beside_a_decoding_neighbour_takes_only_the_bounded_chunk_each_step(make_engine, hf_greedy):
    # A target no step can meet: beside the neighbour's decodes only the guaranteed block of prefill.
    engine, events = make_engine(max_step_s=1e-6)
    neighbour = EngineRequest("neighbour", _prompt(1, 6), SamplingParams(max_tokens=80, **GREEDY), tenant="n")
    long = EngineRequest("long", _prompt(2, 150), SamplingParams(max_tokens=3, **GREEDY), tenant="l")

    tokens, _ = _run(engine, neighbour, long)

    for request in (neighbour, long):
        assert tokens[request.request_id] == hf_greedy(request.prompt_token_ids, request.params.max_tokens)
    beside = [e for e in events if isinstance(e, StepEvent) and {i.request_id for i in e.items} == {"neighbour", "long"}]
    long_tokens = [next(i.tokens for i in e.items if i.request_id == "long") for e in beside]
    # Without the bound the long prompt would take the step's whole budget, 63 tokens beside one decode; with
    # it, a block a step, fewer rows where deep into the prompt a block's attention would cost more than at
    # its start (scheduler/step_budget.py's StepTimeBound.granted), never none.
    assert len(long_tokens) >= 150 // BLOCK
    assert long_tokens[0] == BLOCK and all(1 <= n <= BLOCK for n in long_tokens)
    assert all(next(i.tokens for i in e.items if i.request_id == "neighbour") == 1 for e in beside[: 150 // BLOCK])


def test_every_step_beside_a_decode_fits_its_target_under_the_fitted_cost(make_engine):
    engine, _ = make_engine(max_step_s=0.002)
    neighbour = EngineRequest("neighbour", _prompt(3, 6), SamplingParams(max_tokens=60, **GREEDY), tenant="n")
    long = EngineRequest("long", _prompt(4, 200), SamplingParams(max_tokens=2, **GREEDY), tenant="l")

    _, planned = _run(engine, neighbour, long)

    checked = 0
    for plan, cost, target in planned:
        features = step_features(plan)
        if target is None or not features.decode_rows:
            continue
        checked += 1
        assert features.prefill_tokens <= BLOCK or predict(cost, features) <= target + 1e-9
    assert checked >= 10
    # The fit follows this machine's steps, not the CPU-scale prior it started from.
    assert engine.scheduler.step_cost.observed > 0
    assert engine.scheduler.step_cost.coefficients() != engine.scheduler.config.step_cost_prior
