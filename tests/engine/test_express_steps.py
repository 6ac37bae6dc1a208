"""Express steps: a light tenant's short request that arrives during a flood's step runs between its layers.

The light request is handed to the engine right after the flood's step is planned
(from inside ``Scheduler.schedule``), so it is in the inbox when that step's forward
reaches its first layer boundary: deterministic, whatever the machine's speed.
Every request's tokens are checked against HF's greedy ones, so an express step
that disturbed the step under way (its KV, its LoRA slots, its plan) would show.
"""

from __future__ import annotations

import random
import time

import pytest

from engine import express_steps
from engine.events import StepEvent
from engine.request import EngineRequest, SamplingParams
from engine.stream import BlockingCollector
from scheduler import StepPlan

GREEDY = dict(temperature=0.0, ignore_eos=True)
FLOOD_PROMPT = 60  # a few 64-token steps each: a light request can arrive while one is under way


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(length)]


def _collect(collector: BlockingCollector) -> tuple[list[int], str | None]:
    ids, error = [], None
    for delta in collector:
        ids.extend(delta.token_ids)
        error = error or delta.error
    return ids, error


def _run_with_arrival(engine, light: EngineRequest, flood: list[EngineRequest], arrive_during: int = 2,
                      then=lambda: None):
    """Run ``flood``; hand ``light`` to the engine (and call ``then``) as the flood's ``arrive_during``-th
    prefill step is planned.

    Returns the collectors by request id and the id of that step's plan (``id(plan)``)."""
    collectors = {r.request_id: BlockingCollector() for r in [*flood, light]}
    schedule, seen, arrival_plan = engine.scheduler.schedule, [0], []

    def schedule_and_maybe_send():
        plan = schedule()
        prefilling = {c.seq.seq_id for c in plan.chunks if c.num_tokens > 1}
        if not arrival_plan and len(prefilling) >= 1:
            seen[0] += 1
            if seen[0] == arrive_during:
                arrival_plan.append(plan)
                engine._accept_request(light, collectors[light.request_id].push)
                then()
        return plan

    engine.scheduler.schedule = schedule_and_maybe_send
    for request in flood:
        engine._accept_request(request, collectors[request.request_id].push)
    results = {rid: _collect(c) for rid, c in collectors.items()}
    assert arrival_plan, "the flood never had a second prefill step"
    return results, arrival_plan[0]


def _flood(n: int = 4, max_tokens: int = 8) -> list[EngineRequest]:
    return [EngineRequest(f"flood-{i}", _prompt(i, FLOOD_PROMPT), SamplingParams(max_tokens=max_tokens, **GREEDY),
                          tenant="flood") for i in range(n)]


def _light(max_tokens: int = 4) -> EngineRequest:
    return EngineRequest("light", _prompt(99, 7), SamplingParams(max_tokens=max_tokens, **GREEDY), tenant="light")


def _steps(events: list) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


def _request_ids(step: StepEvent) -> set[str]:
    return {item.request_id for item in step.items}


def _steps_after_express(engine, events: list) -> tuple[list[StepEvent], int]:
    """Checks that the light request's first step was its own and that the books are straight; returns the
    steps and that step's index."""
    steps = _steps(events)
    first_light = next(i for i, s in enumerate(steps) if "light" in _request_ids(s))
    assert _request_ids(steps[first_light]) == {"light"}
    assert sum(s.duration_s for s in steps) == pytest.approx(engine.busy_seconds)
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0
    return steps, first_light


def _assert_greedy(results: dict, requests: list[EngineRequest], hf_greedy) -> None:
    for request in requests:
        ids, error = results[request.request_id]
        assert error is None and ids == hf_greedy(request.prompt_token_ids, request.params.max_tokens)


def test_a_light_request_gets_its_first_token_from_a_step_between_the_floods_layers(make_engine, hf_greedy):
    engine, events = make_engine()
    flood, light = _flood(), _light()
    results, _ = _run_with_arrival(engine, light, flood)

    _assert_greedy(results, [*flood, light], hf_greedy)
    steps, first_light = _steps_after_express(engine, events)
    # The express step is accounted before the step it ran inside, which holds the flood's prefill.
    under_way = steps[first_light + 1]
    assert "light" not in _request_ids(under_way) and any(item.tokens > 1 for item in under_way.items)


def test_under_a_step_bound_the_light_request_also_decodes_between_the_floods_layers(make_engine, hf_greedy,
                                                                                     monkeypatch):
    # A bound no step here comes near, on a clock that makes every wait between layers look far past it: the
    # flood's steps are planned as without the bound, and each layer boundary after the express step finds
    # the light request due for its next token. It arrives during the flood's first step, which decodes
    # nobody yet (a step that decodes a stream under a bound gets no express step of its tier).
    engine, events = make_engine(max_step_s=10.0)
    decodes = engine.scheduler.schedule_express_decodes
    monkeypatch.setattr(engine.scheduler, "schedule_express_decodes",
                        lambda under_way, waited_s, next_chance_s: decodes(under_way, waited_s * 1e6, next_chance_s))
    flood, light = _flood(), _light()
    results, _ = _run_with_arrival(engine, light, flood, arrive_during=1)

    _assert_greedy(results, [*flood, light], hf_greedy)
    steps, first_light = _steps_after_express(engine, events)
    # Its next token came from a decode step of its own, accounted before the step it ran inside ended.
    decode = steps[first_light + 1]
    assert _request_ids(decode) == {"light"} and [item.tokens for item in decode.items] == [1]
    under_way = next(s for s in steps[first_light + 1:] if "light" not in _request_ids(s))
    assert any(item.tokens > 1 for item in under_way.items)


def test_with_express_steps_off_the_light_request_waits_for_the_step_under_way(make_engine, hf_greedy):
    engine, events = make_engine(express_between_layers=False)
    flood, light = _flood(), _light()
    results, _ = _run_with_arrival(engine, light, flood)

    assert results["light"] == (hf_greedy(light.prompt_token_ids, 4), None)
    steps = _steps(events)
    first_light = next(i for i, s in enumerate(steps) if "light" in _request_ids(s))
    assert _request_ids(steps[first_light]) != {"light"}  # it shared a later step with the flood


def test_an_abort_taken_between_layers_waits_for_the_step_end_and_frees_everything(make_engine, hf_greedy):
    engine, _ = make_engine()
    flood, light = _flood(), _light()
    # The abort reaches the inbox just after the light request, so the first layer boundary takes both.
    results, _ = _run_with_arrival(engine, light, flood, then=lambda: engine.abort("flood-0"))

    ids, error = results["flood-0"]
    assert error is None and ids == hf_greedy(flood[0].prompt_token_ids, 8)[:len(ids)] and len(ids) < 8
    for request in [*flood[1:], light]:
        assert results[request.request_id] == (hf_greedy(request.prompt_token_ids, request.params.max_tokens), None)
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0
    assert engine.is_running


def test_a_failing_express_step_ends_the_light_request_alone(make_engine, hf_greedy, monkeypatch):
    engine, _ = make_engine()
    flood, light = _flood(), _light()
    update = engine.scheduler.update

    def update_failing_for_the_light_request(plan, sampled, *accepted):
        if any(c.seq.tenant == "light" for c in plan.chunks):
            raise ValueError("a bug after the express step's forward")
        return update(plan, sampled, *accepted)

    monkeypatch.setattr(engine.scheduler, "update", update_failing_for_the_light_request)
    results, _ = _run_with_arrival(engine, light, flood)

    assert results["light"][1] == "internal engine error"
    for request in flood:
        assert results[request.request_id] == (hf_greedy(request.prompt_token_ids, 8), None)
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0


@pytest.mark.parametrize("again_after_s, inside", [(0.0, True), (1e9, False)])
def test_a_second_light_request_arriving_inside_the_same_long_step_goes_between_its_layers_once_enough_time_passed(
        make_engine, hf_greedy, monkeypatch, again_after_s, inside):
    # No wall-clock wait in a test: the time between two express steps of new requests is set to none
    # (the second one goes in) or to more than any test runs (it waits for the step's end).
    monkeypatch.setattr(express_steps, "EXPRESS_AGAIN_AFTER_S", again_after_s)
    engine, events = make_engine()
    flood, light = _flood(), _light()
    second = EngineRequest("second", _prompt(98, 6), SamplingParams(max_tokens=3, **GREEDY), tenant="second")
    collector = BlockingCollector()
    express = engine.scheduler.schedule_express

    def express_then_send_the_second(*args):
        plan = express(*args)
        if any(c.seq.tenant == "light" for c in plan.chunks):  # it arrives while the first's express step runs
            engine._accept_request(second, collector.push)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule_express", express_then_send_the_second)
    results, _ = _run_with_arrival(engine, light, flood)
    results["second"] = _collect(collector)

    _assert_greedy(results, [*flood, light, second], hf_greedy)
    steps, first_light = _steps_after_express(engine, events)
    under_way = next(i for i in range(first_light + 1, len(steps))
                     if any(item.tokens > 1 and item.request_id.startswith("flood") for item in steps[i].items))
    first_second = next(i for i, s in enumerate(steps) if "second" in _request_ids(s))
    assert (first_second < under_way) == inside  # accounted before the step it ran inside, when it did
    if inside:
        assert _request_ids(steps[first_second]) == {"second"}


@pytest.mark.parametrize("again_after_s, inside", [(0.0, True), (1e9, False)])
def test_a_light_request_already_waiting_when_a_long_step_began_goes_between_its_layers(
        make_engine, hf_greedy, monkeypatch, again_after_s, inside):
    # A long prompt and the light request arrive together, during a first request's step: the long prompt's
    # chunk takes the whole of the next step, and the light request waits in the queue, not in the inbox. Once
    # that step has run ``EXPRESS_AGAIN_AFTER_S`` (none, or more than any test runs) it is asked for between layers.
    monkeypatch.setattr(express_steps, "EXPRESS_AGAIN_AFTER_S", again_after_s)
    engine, events = make_engine()
    first = EngineRequest("first", _prompt(97, 7), SamplingParams(max_tokens=6, **GREEDY), tenant="first")
    flood = [EngineRequest("flood-0", _prompt(0, 3 * FLOOD_PROMPT), SamplingParams(max_tokens=4, **GREEDY),
                           tenant="flood")]
    light = _light()
    collectors = {r.request_id: BlockingCollector() for r in [first, *flood, light]}
    schedule, sent = engine.scheduler.schedule, []

    def schedule_then_send_the_rest():
        plan = schedule()
        if not sent and any(c.seq.seq_id.startswith("first") for c in plan.chunks):
            sent.append(True)
            for request in [*flood, light]:
                engine._accept_request(request, collectors[request.request_id].push)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_then_send_the_rest)
    engine._accept_request(first, collectors["first"].push)
    results = {rid: _collect(c) for rid, c in collectors.items()}

    _assert_greedy(results, [first, *flood, light], hf_greedy)
    steps = _steps(events)
    flood_step = next(i for i, s in enumerate(steps)
                      if any(item.tokens > 1 and item.request_id.startswith("flood") for item in s.items))
    first_light = next(i for i, s in enumerate(steps) if "light" in _request_ids(s))
    assert (first_light < flood_step) == inside  # accounted before the flood's step it ran inside, when it did
    if inside:
        assert _request_ids(steps[first_light]) == {"light"}
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0


class _AskedScheduler:
    """Counts the asks for an express step; plans none, as when the request waiting does not qualify yet."""

    def __init__(self) -> None:
        self.asks = 0

    def schedule_express(self, adapters, seq_ids) -> StepPlan:
        self.asks += 1
        return StepPlan()


@pytest.mark.parametrize("again_after_s, asks", [(0.0, 3), (1e9, 1)])
def test_a_request_waiting_inside_a_long_step_is_asked_for_again_every_express_again_after_s(
        monkeypatch, again_after_s, asks):
    # One that did not qualify when it arrived (a stream was decoding between the layers, and has since ended)
    # was asked for once and then waited for the whole step, however long (the hostile bench's long prompt).
    monkeypatch.setattr(express_steps, "EXPRESS_AGAIN_AFTER_S", again_after_s)
    under_way = express_steps.StepUnderWay(frozenset(), frozenset({"long"}), began_at=time.monotonic())
    scheduler, arrivals = _AskedScheduler(), iter([True, False, False])
    for _ in range(3):
        express_steps.plan_between_layers(under_way, scheduler, lambda: next(arrivals))
    assert scheduler.asks == asks
