"""n > 1: the choices of one request share its prompt's KV blocks and are billed as one request."""

from __future__ import annotations

import asyncio
import time

from engine.events import FinishEvent, StepEvent
from engine.request import Delta, EngineRequest, SamplingParams

PROMPT = list(range(1, 101))  # 6 full blocks of 16 and 4 tokens in a partial one


def _run(engine, request: EngineRequest) -> list[Delta]:
    async def main():
        return [d async for d in engine.generate(request)]

    return asyncio.run(main())


def _wait_idle(engine, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.has_unfinished() or engine.scheduler.num_used_blocks:
        assert time.time() < deadline, "engine still holds sequences or blocks"
        time.sleep(0.01)


def _watch_blocks(engine) -> list[int]:
    """Blocks in use after every step (listeners run on the engine thread, between steps)."""
    seen: list[int] = []
    engine.add_listener(lambda e: seen.append(engine.scheduler.num_used_blocks) if isinstance(e, StepEvent) else None)
    return seen


def test_three_choices_share_the_prompt_blocks_and_finish_as_one_request(make_byte_engine):
    engine, events = make_byte_engine()
    used = _watch_blocks(engine)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, ignore_eos=True)
    deltas = _run(engine, EngineRequest("r", PROMPT, params))

    ids = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in range(3)}
    assert all(len(v) == 10 for v in ids.values()) and len({tuple(v) for v in ids.values()}) == 3
    assert [d.index for d in deltas if d.finish_reason] and deltas[-1].is_last
    assert sum(d.is_last for d in deltas) == 1 and deltas[-1].usage.completion_tokens == 30
    # Shared: 7 prompt blocks once, plus each sibling's own copy of the partial block.
    assert max(used) == 7 + 2 < 3 * 7
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert {it.request_id for s in steps for it in s.items} == {"r"}
    # The prompt is computed once; siblings recompute only its 4-token partial block.
    assert sum(it.tokens for s in steps for it in s.items) == 100 + 2 * 4 + 3 * 9
    [finish] = [e for e in events if isinstance(e, FinishEvent)]
    assert (finish.request_id, finish.prompt_tokens, finish.completion_tokens) == ("r", 100, 30)
    _wait_idle(engine)


def test_seeded_choices_are_reproducible(make_byte_engine):
    engine, _ = make_byte_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, ignore_eos=True)
    first, second = (_run(engine, EngineRequest(f"s{k}", PROMPT[:20], params)) for k in range(2))
    assert [(d.index, d.token_ids) for d in first] == [(d.index, d.token_ids) for d in second]


def test_aborting_the_request_ends_every_choice_and_frees_their_blocks(make_byte_engine):
    engine, events = make_byte_engine()
    params = SamplingParams(max_tokens=200, temperature=1.0, n=4, ignore_eos=True)

    async def main():
        stream = engine.submit(EngineRequest("a", PROMPT, params))
        async for delta in stream:
            if delta.index == 3:  # every choice is running
                break
        await stream.aclose()

    asyncio.run(main())
    _wait_idle(engine)
    [finish] = [e for e in events if isinstance(e, FinishEvent)]
    assert finish.status == "cancelled" and finish.request_id == "a"


def test_a_failing_choice_ends_the_request_and_its_siblings_blocks(make_byte_engine, monkeypatch):
    from engine.grammar import GrammarMatcher, GrammarSpec

    engine, events = make_byte_engine()
    accepted = GrammarMatcher.accept
    calls = []

    def accept_until_the_sixth(self, token_id):  # every choice is running by then
        calls.append(token_id)
        return len(calls) < 6 and accepted(self, token_id)

    monkeypatch.setattr(GrammarMatcher, "accept", accept_until_the_sixth)
    params = SamplingParams(max_tokens=50, temperature=1.0, n=3, grammar=GrammarSpec("json_object"))
    deltas = _run(engine, EngineRequest("f", PROMPT, params))
    assert deltas[-1].is_last and deltas[-1].error and sum(d.is_last for d in deltas) == 1
    [finish] = [e for e in events if isinstance(e, FinishEvent)]
    assert finish.status == "error"
    _wait_idle(engine)
    # The loop keeps serving.
    monkeypatch.setattr(GrammarMatcher, "accept", accepted)
    assert _run(engine, EngineRequest("g", PROMPT[:10], SamplingParams(max_tokens=3, n=2)))[-1].is_last
