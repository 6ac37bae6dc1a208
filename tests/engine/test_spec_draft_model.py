"""Speculative decoding with a draft model: the output of decoding without it, token for token when
greedy and in distribution when sampled, for every row feature, with no block left in either KV pool."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import StepEvent
from engine.grammar import GrammarSpec
from tests.engine.chi_square import chi2_critical, homogeneity
from tests.engine.test_speculative import (COPY_PROMPT, _accepted, _request, _run, _summary, _wait_idle,
                                          check_lora_rows_match_plain_decoding, compare_engines)
from tests.engine.conftest import write_tiny_tokenizer
from tests.tiny_llama import BYTE_LLAMA, write_byte_llama


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different random model with the byte tokenizer: its drafts are mostly rejected."""
    folder = tmp_path_factory.mktemp("byte-draft")
    config = {**BYTE_LLAMA, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def drafting(byte_model_dir: Path):
    """``drafting(draft_dir, **overrides)``: the speculative settings for ``draft_dir`` as the draft model
    (every row drafting whatever its acceptance and the batch)."""

    def settings(draft_dir: Path | None = None, **overrides) -> dict:
        return dict(speculative="draft", draft_model=f"dummy:{draft_dir or byte_model_dir}",
                    num_speculative_tokens=4, speculative_adaptive=False, **overrides)

    return settings


@pytest.fixture
def compare(make_byte_engine, drafting):
    """``compare(requests, draft_dir, draft_settings, **overrides)``: the summaries with speculation off
    and on (asserted equal), the speculative engine's events; both KV pools are empty afterwards
    (n > 1 and preemption with a draft model: tests/engine/test_speculative.py)."""

    def run(requests, draft_dir: Path | None = None, draft_settings: dict | None = None, **overrides):
        got, events, _ = compare_engines(make_byte_engine, requests, drafting(draft_dir, **(draft_settings or {})),
                                         **overrides)
        return got, events

    return run


def test_greedy_output_with_the_same_model_as_draft_is_plain_decodings_with_every_draft_accepted(compare):
    requests = [_request(f"r{i}", COPY_PROMPT[i:], max_tokens=60) for i in range(4)]
    requests.append(_request("opted-out", speculative=False))
    _, events = compare(requests)
    steps = [e for e in events if isinstance(e, StepEvent) and e.draft_tokens]
    assert steps and all(e.accepted_tokens == e.draft_tokens for e in steps)
    assert _accepted(events) > 100


def test_greedy_output_with_a_different_draft_model_is_plain_decodings(compare, other_draft_dir):
    requests = [_request(f"r{i}", COPY_PROMPT[i:], max_tokens=50) for i in range(4)]
    _, events = compare(requests, other_draft_dir)
    steps = [e for e in events if isinstance(e, StepEvent)]
    drafted = sum(e.draft_tokens for e in steps)
    assert drafted and _accepted(events) < drafted, "a different model's drafts are all accepted: no rollback ran"


def test_rejected_drafts_leave_no_block_in_either_pool_mid_run(make_byte_engine, drafting, other_draft_dir):
    engine, events = make_byte_engine(**drafting(other_draft_dir), express_between_layers=False)
    kv = engine._loop.speculator.drafter.kv
    exact = []
    # After each step's verification (its event), every row's draft KV holds blocks for its kept tokens only.
    engine.add_listener(lambda e: exact.append(all(len(r.block_table) == -(-r.computed // kv.block_size)
                                                   for r in kv.rows.values()) and kv.rows != {})
                        if isinstance(e, StepEvent) and e.draft_tokens else None)
    _run(engine, [_request(f"r{i}", COPY_PROMPT[i:], max_tokens=40) for i in range(3)])
    _wait_idle(engine)
    assert exact and all(exact)
    assert kv.num_used_blocks == 0 and not kv.rows
    assert _accepted(events) < sum(e.draft_tokens for e in events if isinstance(e, StepEvent))


def test_a_row_whose_drafts_were_all_accepted_catches_its_draft_kv_up_and_keeps_matching(compare):
    # Long runs of full acceptance: each step's last draft was never fed to the draft model, so every
    # next step must compute it along with the bonus token, or the drafts would stop matching.
    _, events = compare([_request("long", max_tokens=120)])
    steps = [e for e in events if isinstance(e, StepEvent) and e.draft_tokens]
    assert len(steps) > 10 and all(e.accepted_tokens == e.draft_tokens for e in steps)


def test_lora_rows_are_drafted_without_the_adapter_and_verified_with_it(make_byte_engine, drafting, byte_adapter_dir):
    check_lora_rows_match_plain_decoding(make_byte_engine, byte_adapter_dir, drafting())


def test_grammar_rows_match_plain_decoding(compare):
    prompt = list(b'{"a": "xyxyxyxy", "b": [1, 1, 1, 1]} {"a": "xyxyxyxy", "b": [1, 1, 1, 1]} ')
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"],
              "additionalProperties": False}
    requests = [_request("json", prompt, grammar=GrammarSpec("json_schema", json.dumps(schema)), max_tokens=80),
                _request("regex", prompt, grammar=GrammarSpec("regex", "(xy|yx)+z"), max_tokens=40),
                _request("free", max_tokens=40)]
    results, events = compare(requests)
    json.loads(results[0][0])
    assert _accepted(events)


def test_a_draft_pool_too_small_for_a_row_leaves_it_undrafted_not_wrong(compare):
    _, events = compare([_request("big", max_tokens=30), _request("small", COPY_PROMPT[-12:], max_tokens=30)],
                        draft_settings=dict(draft_num_kv_blocks=2))
    assert _accepted(events), "the short row fits the draft pool and drafts"


def test_sampled_output_with_drafts_drawn_from_another_distribution_has_the_plain_samplers_token_frequencies(
        make_byte_engine, drafting):
    # As the prompt-lookup test: seeds 0..N-1 through each engine, every position's counts one
    # distribution by chi-square. The draft model is the model itself, but it sees no penalties: the
    # drafts are drawn from a q that differs from the row's p wherever a penalty moved p, so some are
    # kept and some rejected (a different random model's top 3 rarely meet the model's at all).
    draws, positions = 400, 8
    requests = [_request(f"s{i}", COPY_PROMPT, temperature=1.0, top_k=3, seed=i, max_tokens=positions,
                         presence_penalty=1.5) for i in range(draws)]
    counts = []
    for engine, events in (make_byte_engine(max_num_seqs=32)[0], []), make_byte_engine(max_num_seqs=32, **drafting()):
        outputs = [_summary(d)[1] for d in _run(engine, requests)]
        counts.append([Counter(out[p] for out in outputs) for p in range(positions)])
    drafted = sum(e.draft_tokens for e in events if isinstance(e, StepEvent))
    assert 50 < _accepted(events) < drafted - 50, "too few drafts kept or rejected to tell anything"
    for position in range(1, positions):  # the first token is never drafted
        stat, df = homogeneity(counts[0][position], counts[1][position])
        assert df >= 1 and stat < chi2_critical(df), (position, counts[0][position], counts[1][position])


def test_a_draft_model_with_another_vocabulary_is_refused(byte_model_dir, tmp_path):
    write_tiny_tokenizer(write_byte_llama(tmp_path / "other-vocab"))
    with pytest.raises(ValueError, match="vocabulary differs"):
        Engine(EngineConfig(model=f"dummy:{byte_model_dir}", speculative="draft",
                            draft_model=f"dummy:{tmp_path / 'other-vocab'}", num_kv_blocks=16, max_loras=0))


@pytest.mark.parametrize("settings", [dict(speculative="draft"), dict(draft_model="x"),
                                      dict(speculative="ngram", draft_model="x"), dict(draft_num_kv_blocks=4)])
def test_a_draft_setting_without_its_partner_is_refused(settings):
    with pytest.raises(ValueError):
        EngineConfig(**settings)
