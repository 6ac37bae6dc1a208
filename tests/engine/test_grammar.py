"""Grammar-constrained decoding in the engine: a random model's output parses only because of the mask.

The model is a tiny random Llama with the 256-token byte tokenizer and no stop
token (conftest's ``make_byte_engine``), so it ends a grammar by completing it;
every token id is a byte, so any JSON can be spelled.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.engine import Engine, EngineError
from engine.events import StepEvent
from engine.grammar import GrammarSpec
from engine.request import EngineRequest, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
PERSON_GRAMMAR = GrammarSpec("json_schema", json.dumps(PERSON))


@pytest.fixture
def make_engine(make_byte_engine):
    return make_byte_engine


def _request(request_id: str, prompt: list[int], grammar: GrammarSpec | None = None, adapter: str | None = None,
             **params) -> EngineRequest:
    params = {"max_tokens": 200, "temperature": 0.0, **params}
    return EngineRequest(request_id, prompt, SamplingParams(grammar=grammar, **params), adapter=adapter)


def _finals(engine: Engine, requests: list[EngineRequest]) -> list[tuple[str, str]]:
    """(text, finish_reason) of each request, run concurrently."""

    async def one(request: EngineRequest) -> tuple[str, str]:
        deltas = [d async for d in engine.generate(request)]
        return "".join(d.text for d in deltas), deltas[-1].finish_reason

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def _wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.has_unfinished() or engine.scheduler.num_used_blocks:
        assert time.time() < deadline, "engine still holds sequences or blocks"
        time.sleep(0.01)


def test_a_mixed_batch_gives_every_grammar_row_valid_json(make_engine, byte_adapter_dir):
    engine, _ = make_engine(max_loras=2)
    engine.register_adapter("a", str(byte_adapter_dir))
    requests = []
    for i in range(8):
        sampled = dict(temperature=1.0, seed=i) if i % 2 else {}
        requests.append(_request(f"g{i}", [10 + i, 20, 30], PERSON_GRAMMAR, adapter="a" if i % 4 < 2 else None,
                                 **sampled))
    requests.append(_request("free", [10, 20, 30]))
    requests.append(_request("free-lora", [10, 20, 30], adapter="a", temperature=1.0, seed=3))
    results = _finals(engine, requests)
    for (text, reason), request in zip(results[:8], requests):
        assert reason == "stop", request.request_id
        person = json.loads(text)
        assert set(person) == set(PERSON["properties"]) and 0 <= person["age"] <= 120
        assert person["pet"] in ("cat", "dog") and len(person["name"]) <= 6
    for _, reason in results[8:]:
        assert reason == "length"
    _wait_idle(engine)


def test_a_free_row_gets_the_same_tokens_beside_a_grammar_row_as_alone(make_engine):
    engine, _ = make_engine()
    free = dict(max_tokens=40, temperature=0.8, seed=11)
    alone = engine.generate_batch_sync([_request("alone", [5, 6, 7], **free)])[0][1]
    together = engine.generate_batch_sync([
        _request("json", [5, 6, 7], PERSON_GRAMMAR), _request("free", [5, 6, 7], **free),
        _request("obj", [5, 6, 7], GrammarSpec("json_object"), temperature=1.0, seed=2),
    ])
    assert together[1][1] == alone


def test_max_tokens_cutting_a_grammar_ends_with_length(make_engine):
    engine, _ = make_engine()
    [(text, reason)] = _finals(engine, [_request("cut", [1, 2], PERSON_GRAMMAR, max_tokens=5)])
    assert reason == "length" and text.startswith("{")
    _wait_idle(engine)


def test_a_preempted_grammar_request_resumes_where_its_grammar_was(make_engine):
    # Seeded draws: a matcher that lost or repeated a token on recompute would mask differently and
    # the text would part from the run that was never preempted.
    requests = [_request(f"p{i}", [3 + i] * 6, PERSON_GRAMMAR, max_tokens=110, temperature=1.0, seed=i)
                for i in range(6)]
    roomy, roomy_events = make_engine()
    unpreempted = _finals(roomy, requests)
    assert not any(e.preempted for e in roomy_events if isinstance(e, StepEvent))
    # 30 blocks of 4 tokens cannot hold six ~116-token sequences at once: preemption must happen.
    cramped, events = make_engine(num_kv_blocks=30, block_size=4, policy="fcfs", max_model_len=128)
    results = _finals(cramped, requests)
    assert any(e.preempted for e in events if isinstance(e, StepEvent))
    assert results == unpreempted
    for text, reason in results:
        if reason == "stop":
            json.loads(text)
        else:  # cut by max_tokens: still a prefix the grammar accepts
            assert reason == "length" and text.startswith("{")
    assert any(reason == "stop" for _, reason in results)
    _wait_idle(cramped)


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec("json_schema", '{"type": "fooo"}'), "Unsupported type"),
        (GrammarSpec("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}'), "nope"),
        (GrammarSpec("json_schema", "{not json"), "Expecting property name"),
    ],
)
def test_an_uncompilable_grammar_is_refused_with_the_reason(make_engine, spec, message):
    engine, _ = make_engine()
    with pytest.raises(EngineError, match=message):  # compiled off the caller's thread: its error comes as a delta
        engine.generate_batch_sync([_request("bad", [1, 2], spec)])
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0


def test_length_limited_strings_never_hold_raw_control_characters(make_engine):
    engine, _ = make_engine()
    spec = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "string", "maxLength": 3},
                                                  "minItems": 4, "maxItems": 4}))
    outputs = engine.generate_batch_sync(
        [_request(f"s{i}", [i, 40], spec, temperature=1.5, seed=i) for i in range(6)]
    )
    for text, _ in outputs:
        assert all(len(s) <= 3 for s in json.loads(text)), text  # json.loads refuses raw control characters


@pytest.mark.parametrize("text, accepted", [('"a"b"', False), ('"a\\"b"', True), ('"a\\\\b"', True),
                                            ('"a\\q"', False), ('"abcd"', True), ('"abcde"', False)])
def test_a_length_limited_string_holds_a_quote_or_backslash_only_escaped(text, accepted):
    from engine.grammar_compiler import GrammarCompiler
    from engine.loader import byte_tokenizer

    tokenizer = byte_tokenizer()
    matcher = GrammarCompiler(tokenizer, 256, ()).matcher(
        GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 4})))
    assert all(matcher.accept(t) for t in tokenizer.encode(text).ids) == accepted


def test_free_whitespace_is_bounded_so_a_model_cannot_stall_in_it(make_engine):
    from engine.grammar import MAX_WHITESPACE_RUN

    engine, _ = make_engine()
    matcher = engine.grammars.matcher(GrammarSpec("json_object"))
    [brace] = engine.tokenizer.encode("{")
    [space] = engine.tokenizer.encode(" ")
    assert matcher.accept(brace)
    assert all(matcher.accept(space) for _ in range(MAX_WHITESPACE_RUN))
    assert not matcher.accept(space)


def test_the_mask_forbids_exactly_what_the_matchers_bitmask_forbids_on_a_padded_vocabulary():
    import torch
    import xgrammar as xgr

    from engine.grammar import mask_logits
    from engine.grammar_compiler import GrammarCompiler
    from engine.loader import byte_tokenizer

    vocab = 300  # past the tokenizer's 256 ids and not a multiple of 32: the padding must be masked too
    tokenizer = byte_tokenizer()
    compiler = GrammarCompiler(tokenizer, vocab, ())
    matchers = [compiler.matcher(PERSON_GRAMMAR), None, compiler.matcher(GrammarSpec("json_object")), None]
    for token in tokenizer.encode('{"name": "a').ids:
        assert matchers[0].accept(token)
    logits = torch.randn(len(matchers), vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
    for row in (0, 2):
        matchers[row].fill_mask(bitmask, row)
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2])
    mask_logits(logits, matchers)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0, 256:]).all() and torch.isfinite(logits[1]).all()
