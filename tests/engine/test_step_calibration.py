"""The step cost model's prior timed on this machine before the engine serves (engine/step_calibration.py)."""

from __future__ import annotations

import time

import pytest

from engine.request import MAX_TOP_LOGPROBS, EngineRequest, SamplingParams
from engine.step_calibration import calibrate, prior_of
from engine.step_timer import StepTimer
from scheduler.config import StepCost
from scheduler.plan import StepFeatures, attention_pairs
from scheduler.step_cost import StepCostModel, predict

CONFIGURED = StepCost(base_s=0.012, per_prefill_token_s=6e-4, per_decode_seq_s=1.5e-4, per_context_token_s=3e-6,
                      per_attention_pair_s=1e-9, per_scored_row_s=1e-4)


def test_the_prior_predicts_the_steps_it_was_timed_from():
    prompt, rows = 64, 8
    prior = prior_of(0.10, 0.007, 0.018, 5e-4, CONFIGURED, prompt, rows)
    decode = StepFeatures(0, 1, prompt + 1)
    decode_rows = StepFeatures(0, rows, rows * (prompt + 1))
    prefill = StepFeatures(prompt, 0, prompt, attention_pairs(0, prompt))
    assert predict(prior, decode) == pytest.approx(0.007)
    assert predict(prior, decode_rows) == pytest.approx(0.018)
    assert predict(prior, prefill) == pytest.approx(0.10)
    assert prior.per_scored_row_s == 5e-4
    # The terms these short steps barely show stay the configured ones.
    assert (prior.per_context_token_s, prior.per_attention_pair_s) == (3e-6, 1e-9)


def test_a_machine_three_times_slower_gets_a_prefill_token_three_times_dearer():
    prompt, rows = 64, 8
    configured_times = [predict(CONFIGURED, f) for f in (StepFeatures(prompt, 0, prompt, attention_pairs(0, prompt)),
                                                          StepFeatures(0, 1, prompt + 1),
                                                          StepFeatures(0, rows, rows * (prompt + 1)))]
    prior = prior_of(*(3 * t for t in configured_times), 5e-4, CONFIGURED, prompt, rows)
    assert prior.per_prefill_token_s == pytest.approx(3 * CONFIGURED.per_prefill_token_s, rel=0.05)
    assert prior.base_s == pytest.approx(3 * CONFIGURED.base_s, rel=0.05)


def test_times_out_of_order_give_no_negative_coefficient():
    # Noise can make eight rows time faster than one, or a chunk faster than a decode: the prior stays valid.
    prior = prior_of(0.004, 0.007, 0.006, 5e-4, CONFIGURED, 64, 8)
    assert min(prior.as_tuple()) >= 0
    assert prior.per_decode_seq_s == 0 and prior.per_prefill_token_s == 0
    StepCostModel(prior)  # refuses a negative prior


def test_an_engine_starts_from_a_prior_timed_on_this_machine(make_engine):
    engine, _ = make_engine()
    engine.generate_batch_sync([EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))])
    calibration = engine.calibration
    assert calibration is not None
    assert min(calibration.prefill_s, calibration.decode_s, calibration.decode_rows_s, calibration.scored_row_s) > 0
    assert engine.scheduler.step_cost.prior == calibration.prior
    assert calibration.prior != StepCost()


def test_calibration_gives_back_its_blocks_and_no_listener_hears_of_it(make_engine):
    engine, events = make_engine()
    engine.generate_batch_sync([EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))])
    assert engine.calibration is not None
    assert engine.scheduler.num_used_blocks == 0
    assert engine.scheduler.block_manager.num_cached_blocks <= 1  # the request's own prompt, nothing of calibration's
    ids = {item.request_id for event in events for item in getattr(event, "items", ())}
    ids |= {event.request_id for event in events if hasattr(event, "request_id")}
    assert ids == {"r"}


def test_without_calibration_the_configured_prior_stays(make_engine):
    engine, _ = make_engine(calibrate_step_cost=False)
    engine.generate_batch_sync([EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))])
    assert engine.calibration is None
    assert engine.scheduler.step_cost.prior == StepCost()


def test_a_pool_too_small_for_the_timed_steps_keeps_the_configured_prior(make_engine):
    engine, _ = make_engine(calibrate_step_cost=False, num_kv_blocks=8)  # 4-token blocks: one 65-token row is 17
    assert calibrate(engine.scheduler, engine.runner, StepTimer("cpu"), engine.tokenizer) is None
    assert engine.scheduler.num_used_blocks == 0
    assert engine.scheduler.step_cost.prior == StepCost()


def test_a_scored_rows_cost_is_timed_through_the_scoring_the_engine_runs(make_engine, monkeypatch):
    """Timing the LM head, softmax and top-k alone left out each row's logprobs and its alternatives' texts, about
    as much again, so a scored chunk was planned at half its cost (bench/RESULTS.md): the calibration runs
    engine/prompt_scoring.py itself, at the most alternatives a request may ask, and times all of it."""
    import engine.step_calibration as step_calibration

    scoring, calls = step_calibration.score_prompts, []

    def slower_scoring(hidden, wanted, head_logits, tokenizer, *args, **kwargs):
        scoring(hidden, wanted, head_logits, tokenizer, *args, **kwargs)
        calls.append((hidden.shape[0], [w.state.request.params.prompt_logprobs for w in wanted],
                      [len(w.state.prompt_scores) for w in wanted]))
        time.sleep(0.01)  # per-row work the head alone does not have

    monkeypatch.setattr(step_calibration, "score_prompts", slower_scoring)
    engine, _ = make_engine(calibrate_step_cost=False)
    calibration = calibrate(engine.scheduler, engine.runner, StepTimer("cpu"), engine.tokenizer)
    rows = calls[0][0]
    assert all(call == (rows, [MAX_TOP_LOGPROBS], [rows + 1]) for call in calls)
    assert calibration.scored_row_s >= 0.01 / rows
