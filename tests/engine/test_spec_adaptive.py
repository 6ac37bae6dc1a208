"""Adaptive speculation: a row whose drafts are rejected stops drafting and tries again later; a batch
size drafts as many tokens a row as give its steps the most tokens per second (none where drafted steps
give fewer than plain ones), the other lengths run only to re-measure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.request import SamplingParams
from engine.sampler import SampledToken
from engine.spec_gate import BatchGate, draft_lengths
from engine.speculative import SpeculativeConfig, Speculator
from scheduler import Scheduler, SchedulerConfig, Sequence

# A prompt whose last two tokens came before: prompt lookup always has a draft.
LOOPING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _decoding(rows: int) -> tuple[Scheduler, dict]:
    sched = Scheduler(SchedulerConfig(num_blocks=400, block_size=4, max_num_seqs=64, max_num_batched_tokens=2048,
                                      max_model_len=256, standard_min_share=0.0))
    states = {}
    for i in range(rows):
        seq = Sequence(f"s{i}", list(LOOPING), max_tokens=100, tenant=f"t{i}")
        sched.add(seq)
        states[seq.seq_id] = SimpleNamespace(seq=seq, grammar=None,
                                             request=SimpleNamespace(speculative=True, params=SamplingParams()))
    plan = sched.schedule()
    sched.update(plan, {c.seq.seq_id: 7 for c in plan.chunks})  # 7 after "5 6": the lookup drafts 8 9 5 6
    return sched, states


def _next(token: int) -> int:
    """The loop's token after ``token``: what the fake model samples, so the lookup always has a draft."""
    return 5 + (token - 4) % 5


def _step(sched: Scheduler, speculator: Speculator, states: dict, accept: bool | int) -> int:
    """One step that accepts all drafts, none, or (an int) that many at most; how many tokens it drafted."""
    plan = sched.schedule()
    speculator.draft(plan, states.get)
    sampling = [c for c in plan.chunks if c.samples]
    keep = (1 << 30 if accept else 0) if isinstance(accept, bool) else accept
    kept = {c.seq.seq_id: c.draft_token_ids[:keep] for c in sampling}
    last = {c.seq.seq_id: ([c.seq.all_token_ids[-1]] + kept[c.seq.seq_id])[-1] for c in sampling}
    runs = [[SampledToken(t) for t in kept[c.seq.seq_id]] + [SampledToken(_next(last[c.seq.seq_id]))]
            for c in sampling]
    speculator.observe(sampling, runs, 0.01)
    sched.update(plan, {c.seq.seq_id: run[-1].token_id for c, run in zip(sampling, runs)}, kept)
    return sum(len(c.draft_token_ids) for c in plan.chunks)


def _speculator(sched: Scheduler, **config) -> Speculator:
    """A speculator whose batch gate always lets the step draft 4 a row: these tests are about its rows."""
    speculator = Speculator(SpeculativeConfig(**{"num_tokens": 4, **config}), sched, ())
    speculator.gate.draft_length = lambda rows: 4
    return speculator


def test_a_row_whose_drafts_are_rejected_stops_drafting_and_tries_again_later():
    sched, states = _decoding(1)
    speculator = _speculator(sched, retry_after_steps=5)
    assert _step(sched, speculator, states, accept=False) == 4
    drafted = [_step(sched, speculator, states, accept=False) for _ in range(12)]
    assert 0 in drafted, "a row whose every draft was rejected kept drafting"
    quiet = drafted.index(0)
    assert drafted[quiet:quiet + 5] == [0] * 5
    assert any(drafted[quiet + 5:]), "a resting row never tried again"
    sched.check_invariants()


def test_a_row_whose_drafts_are_accepted_keeps_drafting():
    sched, states = _decoding(1)
    speculator = _speculator(sched)
    assert all(_step(sched, speculator, states, accept=True) for _ in range(8))


def test_where_the_gate_drafts_the_most_a_row_that_was_cut_short_still_drafts_the_most():
    sched, states = _decoding(1)  # positions are cheap: the gate's length is --num-speculative-tokens
    speculator = _speculator(sched)
    assert [_step(sched, speculator, states, accept=k) for k in (1, 0, 2, True)] == [4, 4, 4, 4]


def test_where_the_gate_drafts_fewer_a_row_cut_short_drafts_what_it_kept_and_doubles_back_once_kept_whole():
    sched, states = _decoding(1)
    speculator = _speculator(sched, num_tokens=8)  # the gate's 4 of at most 8: positions are dear
    assert _step(sched, speculator, states, accept=2) == 4
    assert _step(sched, speculator, states, accept=0) == 2, "a row that kept 2 of 4 drafted 4 again"
    assert _step(sched, speculator, states, accept=True) == 1, "a row that kept none drafted more than one"
    assert [_step(sched, speculator, states, accept=True) for _ in range(3)] == [2, 4, 4]  # the gate's 4 at most
    sched.check_invariants()


def test_without_adaptation_every_row_drafts_the_most_whatever_it_kept():
    sched, states = _decoding(1)
    speculator = _speculator(sched, adaptive=False)
    assert [_step(sched, speculator, states, accept=k) for k in (0, 1, 0, 3)] == [4, 4, 4, 4]


def test_the_batch_gate_lets_the_faster_mode_run_and_tries_the_other_now_and_then():
    gate = BatchGate((0, 4), explore_every=10)
    for _ in range(3):  # drafting: 2 tokens per 0.03 s; plain: 1 token per 0.01 s
        gate.observe(32, 4, 64, 0.03)
        gate.observe(32, 0, 32, 0.01)
    choices = [gate.draft_length(32) for _ in range(40)]
    assert choices.count(4) == 4 and choices.count(0) == 36
    assert gate.draft_length(1) == 4  # a batch size not measured yet drafts first
    for _ in range(3):
        gate.observe(1, 4, 3, 0.012)
        gate.observe(1, 0, 1, 0.01)
    choices = [gate.draft_length(1) for _ in range(40)]
    assert choices.count(0) == 4


def test_the_batch_gate_picks_the_draft_length_that_gives_the_most_tokens_a_second_and_tries_each_other():
    gate = BatchGate(draft_lengths(4), explore_every=10)
    assert gate.lengths == (0, 1, 2, 4)
    # At 8 rows each drafted position costs: 1 draft a row gives the most tokens a second.
    step = {0: (8, 0.011), 1: (14, 0.016), 2: (17, 0.021), 4: (24, 0.031)}  # tokens, seconds

    def run() -> int:
        length = gate.draft_length(8)
        gate.observe(8, length, *step[length])
        return length

    warmup = [run() for _ in range(12)]
    assert warmup == [4, 2, 1, 0] * 3  # each length measured before any is preferred, the longest first
    choices = [run() for _ in range(60)]
    assert choices.count(1) == 54
    assert sorted(c for c in choices if c != 1) == [0, 0, 2, 2, 4, 4]


def test_draft_lengths_are_none_the_powers_of_two_below_the_most_and_the_most():
    assert draft_lengths(1) == (0, 1)
    assert draft_lengths(3) == (0, 1, 2, 3)
    assert draft_lengths(8) == (0, 1, 2, 4, 8)
    with pytest.raises(ValueError):
        BatchGate((1, 2))


def test_an_opted_out_request_and_stop_tokens_are_never_drafted():
    sched, states = _decoding(2)
    states["s0"].request.speculative = False
    states["s1"].request.params = SamplingParams(stop_token_ids=(9,))
    speculator = _speculator(sched)
    plan = sched.schedule()
    speculator.draft(plan, states.get)
    drafts = {c.seq.seq_id: c.draft_token_ids for c in plan.chunks}
    assert drafts == {"s0": [], "s1": [8]}  # the lookup's 8 9 5 6 stops short of the stop token 9


def test_a_batch_past_max_rows_never_drafts():
    sched, states = _decoding(17)
    assert _step(sched, _speculator(sched, max_rows=16), states, accept=True) == 0
    sched, states = _decoding(16)
    assert _step(sched, _speculator(sched, max_rows=16), states, accept=True) == 16 * 4
