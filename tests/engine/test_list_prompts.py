"""List prompts: several prompts in one request, each run as n sequences, choices indexed prompt-major."""

from __future__ import annotations

import asyncio

import pytest

from engine.events import FinishEvent, StepEvent
from engine.request import Delta, EngineRequest, SamplingParams
from engine.validation import InvalidRequest
from tests.engine.test_choices import _run, _wait_idle

PROMPTS = [list(range(1, 41)), list(range(50, 57)), list(range(100, 133))]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tokens_by_choice(deltas: list[Delta]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in deltas:
        out.setdefault(d.index, []).extend(d.token_ids)
    return out


def test_each_prompt_of_a_list_gets_the_tokens_it_gets_alone(make_byte_engine):
    engine, events = make_byte_engine()
    params = SamplingParams(max_tokens=6, **GREEDY)
    together = _tokens_by_choice(_run(engine, EngineRequest("list", PROMPTS[0], params,
                                                            more_prompts=tuple(PROMPTS[1:]))))
    alone = [_tokens_by_choice(_run(engine, EngineRequest(f"one{i}", p, params)))[0] for i, p in enumerate(PROMPTS)]
    assert [together[i] for i in range(3)] == alone
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert "list" in {it.request_id for s in steps for it in s.items}
    finish = next(e for e in events if isinstance(e, FinishEvent) and e.request_id == "list")
    assert (finish.prompt_tokens, finish.completion_tokens) == (sum(map(len, PROMPTS)), 18)
    _wait_idle(engine)


def test_choices_are_indexed_prompt_major_with_seeds_as_if_each_prompt_were_alone(make_byte_engine):
    engine, _ = make_byte_engine()
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2, ignore_eos=True)
    deltas = _run(engine, EngineRequest("ln", PROMPTS[0], params, more_prompts=(PROMPTS[1],)))
    together = _tokens_by_choice(deltas)
    assert sorted(together) == [0, 1, 2, 3]
    assert sum(d.is_last for d in deltas) == 1 and deltas[-1].usage.completion_tokens == 20
    assert deltas[-1].usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    second = _tokens_by_choice(_run(engine, EngineRequest("alone", PROMPTS[1], params)))
    assert [together[2], together[3]] == [second[0], second[1]]
    _wait_idle(engine)


def test_every_prompt_is_scored_on_its_own_first_delta(make_byte_engine):
    engine, _ = make_byte_engine()
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY)
    deltas = _run(engine, EngineRequest("scored", PROMPTS[1], params, more_prompts=(PROMPTS[2],)))
    scored = {d.index: d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None}
    alone = next(d.prompt_logprobs for d in _run(engine, EngineRequest("s2", PROMPTS[2], params)) if d.prompt_logprobs)
    assert [s.token_id for s in scored[0]] == PROMPTS[1] and [s.token_id for s in scored[1]] == PROMPTS[2]
    assert [s.logprob for s in scored[1][1:]] == pytest.approx([s.logprob for s in alone[1:]], abs=1e-5)


def test_aborting_a_list_request_frees_every_prompts_blocks(make_byte_engine):
    engine, events = make_byte_engine()
    params = SamplingParams(max_tokens=200, temperature=1.0, n=2, ignore_eos=True)

    async def main():
        stream = engine.submit(EngineRequest("gone", PROMPTS[0], params, more_prompts=tuple(PROMPTS[1:])))
        async for delta in stream:
            if delta.index == 5:
                break
        await stream.aclose()

    asyncio.run(main())
    _wait_idle(engine)
    [finish] = [e for e in events if isinstance(e, FinishEvent)]
    assert finish.status == "cancelled"


@pytest.mark.parametrize("more, param", [(([],), "prompt"), (([10**6],), "prompt"), (([1] * 600,), "max_tokens")])
def test_a_bad_entry_anywhere_in_the_list_is_refused(make_byte_engine, more, param):
    engine, _ = make_byte_engine()
    with pytest.raises(InvalidRequest) as e:
        engine.check(EngineRequest("bad", [1, 2], SamplingParams(max_tokens=4), more_prompts=more))
    assert e.value.param == param
