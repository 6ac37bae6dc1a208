"""Adaptive speculation: a row whose drafts are rejected stops drafting and tries again later; a batch
large enough that drafts cost more than they can save drafts nothing."""

from __future__ import annotations

from types import SimpleNamespace

from engine.request import SamplingParams
from engine.speculative import SpeculativeConfig, Speculator
from scheduler import Scheduler, SchedulerConfig, Sequence
from scheduler.config import StepCost

# A prompt whose last two tokens came before: prompt lookup always has a draft.
LOOPING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _decoding(rows: int, cost: StepCost) -> tuple[Scheduler, dict]:
    sched = Scheduler(SchedulerConfig(num_blocks=400, block_size=4, max_num_seqs=64, max_num_batched_tokens=2048,
                                      max_model_len=256, step_cost_prior=cost, standard_min_share=0.0))
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


def _step(sched: Scheduler, speculator: Speculator, states: dict, accept: bool) -> int:
    """One step that accepts all drafts or none; how many tokens it drafted."""
    plan = sched.schedule()
    speculator.draft(plan, states.get)
    drafted = [(c, len(c.draft_token_ids) if accept else 0) for c in plan.chunks if c.draft_token_ids]
    speculator.observe(drafted)
    kept = {c.seq.seq_id: c.draft_token_ids[:n] for c, n in drafted}
    last = {c.seq.seq_id: ([c.seq.all_token_ids[-1]] + kept.get(c.seq.seq_id, []))[-1] for c in plan.chunks}
    sched.update(plan, {seq_id: _next(token) for seq_id, token in last.items()}, kept)
    return sum(len(c.draft_token_ids) for c in plan.chunks)


CHEAP_DRAFTS = StepCost(base_s=0.05, per_prefill_token_s=1e-4, per_decode_seq_s=1e-4, per_context_token_s=0.0)


def test_a_row_whose_drafts_are_rejected_stops_drafting_and_tries_again_later():
    sched, states = _decoding(1, CHEAP_DRAFTS)
    speculator = Speculator(SpeculativeConfig(num_tokens=4, retry_after_steps=5), sched, ())
    assert _step(sched, speculator, states, accept=False) == 4
    drafted = [_step(sched, speculator, states, accept=False) for _ in range(12)]
    assert 0 in drafted, "a row whose every draft was rejected kept drafting"
    quiet = drafted.index(0)
    assert drafted[quiet:quiet + 5] == [0] * 5
    assert any(drafted[quiet + 5:]), "a resting row never tried again"
    sched.check_invariants()


def test_a_row_whose_drafts_are_accepted_keeps_drafting():
    sched, states = _decoding(1, CHEAP_DRAFTS)
    speculator = Speculator(SpeculativeConfig(num_tokens=4), sched, ())
    assert all(_step(sched, speculator, states, accept=True) for _ in range(8))


def test_a_batch_that_is_no_longer_bound_by_weight_reads_drafts_nothing():
    # A drafted position costs as much as a whole decode row: with 32 rows a draft would need to be
    # accepted more often than always to pay for itself.
    costly = StepCost(base_s=0.01, per_prefill_token_s=1e-3, per_decode_seq_s=1e-3, per_context_token_s=0.0)
    sched, states = _decoding(32, costly)
    speculator = Speculator(SpeculativeConfig(num_tokens=4), sched, ())
    assert _step(sched, speculator, states, accept=True) == 0
    sched, states = _decoding(1, costly)
    speculator = Speculator(SpeculativeConfig(num_tokens=4), sched, ())
    assert _step(sched, speculator, states, accept=True) == 4


def test_an_opted_out_request_and_stop_tokens_are_never_drafted():
    sched, states = _decoding(2, CHEAP_DRAFTS)
    states["s0"].request.speculative = False
    states["s1"].request.params = SamplingParams(stop_token_ids=(9,))
    speculator = Speculator(SpeculativeConfig(num_tokens=4), sched, ())
    plan = sched.schedule()
    speculator.draft(plan, states.get)
    drafts = {c.seq.seq_id: c.draft_token_ids for c in plan.chunks}
    assert drafts == {"s0": [], "s1": [8]}  # the lookup's 8 9 5 6 stops short of the stop token 9
