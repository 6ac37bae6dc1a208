"""Speculative decoding in the engine: the same output as decoding without it, for every row feature,
with drafts really drafted and accepted, and no KV block left behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

from engine.engine import Engine
from engine.events import StepEvent
from engine.grammar import GrammarSpec
from engine.request import Delta, EngineRequest, SamplingParams
from tests.engine.chi_square import chi2_critical, homogeneity

# Drafting whatever the acceptance and the batch, so that every test drafts however fast its steps are.
SPECULATIVE = dict(speculative="ngram", num_speculative_tokens=5, speculative_adaptive=False)
# A prompt that repeats itself: prompt lookup has something to draft from the first step.
COPY_PROMPT = list(b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef ")


def _request(request_id: str, prompt: list[int] = COPY_PROMPT, adapter: str | None = None, speculative: bool = True,
             **params) -> EngineRequest:
    params = {"max_tokens": 60, "temperature": 0.0, **params}
    return EngineRequest(request_id, prompt, SamplingParams(**params), adapter=adapter, speculative=speculative)


def _run(engine: Engine, requests: list[EngineRequest]) -> list[list[Delta]]:
    """Every request's deltas, the requests run concurrently."""

    async def one(request: EngineRequest) -> list[Delta]:
        return [d async for d in engine.generate(request)]

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def _summary(deltas: list[Delta]) -> tuple:
    """(text, token ids, finish reason) of each choice, then the request's usage and error."""
    choices = []
    for index in sorted({d.index for d in deltas}):
        mine = [d for d in deltas if d.index == index]
        choices.append(("".join(d.text for d in mine), [t for d in mine for t in d.token_ids], mine[-1].finish_reason))
    last = deltas[-1]
    # Cached tokens are left out: which of two requests with one prompt hits the other's blocks is a race.
    return (*choices[0], (last.usage.prompt_tokens, last.usage.completion_tokens), last.error, choices[1:])


def _wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.has_unfinished() or engine.scheduler.num_used_blocks:
        assert time.time() < deadline, "engine still holds sequences or blocks"
        time.sleep(0.01)
    engine.scheduler.check_invariants()


def _accepted(events: list) -> int:
    return sum(e.accepted_tokens for e in events if isinstance(e, StepEvent))


@pytest.fixture
def compare(make_byte_engine):
    """``compare(requests, **engine_overrides)``: each request's summary with speculation off and on
    (asserted equal), and the speculative engine's events."""

    def run(requests: list[EngineRequest], speculative: dict = SPECULATIVE, **overrides) -> tuple[list[tuple], list]:
        return compare_engines(make_byte_engine, requests, speculative, **overrides)[:2]

    return run


def compare_engines(make_engine, requests: list[EngineRequest], speculative: dict, **overrides
                    ) -> tuple[list[tuple], list, Engine]:
    """Each request's summary with speculation off and on (``speculative``'s settings; asserted equal),
    the speculative engine's events, and that engine, idle with no block held."""
    plain, _ = make_engine(**overrides)
    expected = [_summary(d) for d in _run(plain, requests)]
    fast, events = make_engine(**speculative, **overrides)
    got = [_summary(d) for d in _run(fast, requests)]
    assert got == expected
    _wait_idle(fast)
    drafter = fast._loop.speculator.drafter
    assert drafter is None or (drafter.kv.num_used_blocks == 0 and not drafter.kv.rows), "draft KV left behind"
    return got, events, fast


def test_greedy_output_is_token_for_token_that_of_plain_decoding_with_drafts_accepted(compare):
    requests = [_request(f"r{i}", COPY_PROMPT[i:], max_tokens=80) for i in range(6)]
    requests.append(_request("opted-out", speculative=False))
    results, events = compare(requests)
    assert _accepted(events) > 20
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(e.accepted_tokens <= e.draft_tokens for e in steps)
    drafted_rows = [e for e in steps if e.draft_tokens and len(e.items) > 1]
    assert drafted_rows, "rows with and without drafts never shared a step"
    assert all(r[3][1] == len(r[1]) for r in results)


def test_an_opted_out_request_is_never_drafted_for(make_byte_engine):
    engine, events = make_byte_engine(**SPECULATIVE)
    _run(engine, [_request("out", speculative=False)])
    assert not any(e.draft_tokens for e in events if isinstance(e, StepEvent))


def test_stop_strings_and_max_tokens_inside_a_drafted_run_cut_the_output_where_plain_decoding_does(
        make_byte_engine, compare):
    plain, _ = make_byte_engine()
    text = "".join(d.text for d in _run(plain, [_request("probe", max_tokens=80)])[0])
    stop = text[30:33]  # a string the greedy output reaches late, in the middle of a copied run
    requests = [_request("stop", stop=(stop,), max_tokens=80)]
    requests += [_request(f"len{n}", max_tokens=n) for n in (7, 23, 41)]
    results, events = compare(requests)
    assert results[0][2] == "stop" and stop not in results[0][0]
    assert [r[2] for r in results[1:]] == ["length"] * 3
    assert [r[3][1] for r in results[1:]] == [7, 23, 41]
    assert _accepted(events)


def test_logprobs_of_accepted_tokens_are_those_of_plain_decoding(make_byte_engine):
    requests = [_request("lp", logprobs=3, max_tokens=50)]
    plain, _ = make_byte_engine()
    fast, events = make_byte_engine(**SPECULATIVE)
    [want], [got] = _run(plain, requests), _run(fast, requests)
    want_lp = [lp for d in want for lp in d.logprobs]
    got_lp = [lp for d in got for lp in d.logprobs]
    assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp]
    for g, w in zip(got_lp, want_lp):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
    assert _accepted(events)
    assert len(got) < len(want), "accepted tokens go out together, several to a delta"


def test_penalties_and_logit_bias_apply_at_each_drafted_position_as_after_the_tokens_before_it(compare):
    requests = [_request("freq", frequency_penalty=0.3, max_tokens=60),
                _request("pres", presence_penalty=0.5, max_tokens=60),
                _request("rep", repetition_penalty=1.3, max_tokens=60),
                _request("bias", logit_bias=((ord("a"), 3.0), (ord(" "), -2.0)), max_tokens=60),
                _request("min", min_tokens=20, max_tokens=40)]
    _, events = compare(requests)
    assert _accepted(events)


@pytest.fixture(params=["ngram", "draft"])
def drafting_by(request, byte_model_dir) -> dict:
    """The speculative settings of prompt lookup, then of a draft model (the model itself, so drafts are kept)."""
    if request.param == "ngram":
        return SPECULATIVE
    return {**SPECULATIVE, "speculative": "draft", "draft_model": f"dummy:{byte_model_dir}"}


def test_n_choices_each_draft_on_their_own(compare, drafting_by):
    _, events = compare([_request("n3", n=3, max_tokens=50), _request("seeded", n=2, temperature=0.0, max_tokens=30)],
                        drafting_by)
    assert _accepted(events)


def test_a_preempted_drafting_request_resumes_with_identical_output(compare, drafting_by):
    requests = [_request(f"p{i}", COPY_PROMPT[i:], max_tokens=70) for i in range(5)]
    # 20 blocks of 4 tokens cannot hold five ~140-token sequences at once: preemption must happen.
    _, events = compare(requests, drafting_by, num_kv_blocks=40, block_size=4, policy="fcfs")
    assert any(e.preempted for e in events if isinstance(e, StepEvent))
    assert _accepted(events)


def test_lora_rows_are_verified_with_their_adapter(make_byte_engine, byte_adapter_dir):
    check_lora_rows_match_plain_decoding(make_byte_engine, byte_adapter_dir, SPECULATIVE)


def check_lora_rows_match_plain_decoding(make_engine, adapter_dir, speculative: dict) -> None:
    """An adapter's row and a base row, with speculation off and on (``speculative``'s settings): the same
    output, drafts accepted, and the adapter visibly changing its row."""
    requests = [_request("lora", adapter="a", max_tokens=60), _request("base", max_tokens=60)]
    outputs = []
    for settings in ({}, speculative):
        engine, events = make_engine(max_loras=2, **settings)
        engine.register_adapter("a", str(adapter_dir))
        outputs.append([_summary(d) for d in _run(engine, requests)])
    assert outputs[0] == outputs[1]
    assert outputs[0][0][1] != outputs[0][1][1], "the adapter changes nothing: the test proves nothing"
    assert _accepted(events)


def test_grammar_rows_draft_only_what_their_grammar_allows_and_match_plain_decoding(compare):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a", "b"], "additionalProperties": False}
    prompt = list(b'{"a": "xyxyxyxy", "b": [1, 1, 1, 1]} {"a": "xyxyxyxy", "b": [1, 1, 1, 1]} ')
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    requests = [_request("json", prompt, grammar=grammar, max_tokens=120),
                _request("regex", prompt, grammar=GrammarSpec("regex", "(xy|yx)+z"), max_tokens=40),
                _request("free", max_tokens=40)]
    results, events = compare(requests)
    assert results[0][2] == "stop"
    json.loads(results[0][0])
    assert _accepted(events)


def test_sampled_output_has_the_plain_samplers_token_frequencies_at_every_position(make_byte_engine):
    # Seeds 0..N-1 through each engine: every position's token counts must pass a chi-square test of
    # being one distribution (speculation draws other uniforms, so only the distribution can match).
    # The prompt holds the model's own greedy continuation of its tail, so lookup drafts are likely.
    draws, positions = 400, 8
    plain, _ = make_byte_engine(max_num_seqs=32)
    greedy = _summary(_run(plain, [_request("g", max_tokens=24)])[0])[1]
    prompt = COPY_PROMPT + greedy + COPY_PROMPT
    requests = [_request(f"s{i}", prompt, temperature=1.0, top_k=3, seed=i, max_tokens=positions) for i in range(draws)]
    counts = []
    for engine, events in (plain, []), make_byte_engine(max_num_seqs=32, **SPECULATIVE):
        outputs = [_summary(d)[1] for d in _run(engine, requests)]
        counts.append([Counter(out[p] for out in outputs) for p in range(positions)])
    assert _accepted(events) > 50, "too few drafts kept to tell anything"
    for position in range(1, positions):  # the first token is never drafted
        stat, df = homogeneity(counts[0][position], counts[1][position])
        assert df >= 1 and stat < chi2_critical(df), (position, counts[0][position], counts[1][position])
