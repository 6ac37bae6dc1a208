"""Fair share's latency half: a newcomer's step of its own, and preemption between the tenants of a tier."""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence

from scheduler_driver import engine_step


def config(**kw) -> SchedulerConfig:
    base = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                standard_min_share=0.0)
    return SchedulerConfig(**{**base, **kw})


def make(tenant: str, n: int, prompt: int, max_tokens: int, tier: str = "standard") -> Sequence:
    return Sequence(f"{tenant}-{n}", [(n * 31 + i) % 500 for i in range(prompt)], tier=tier, tenant=tenant,
                    max_tokens=max_tokens)


def prefill_of(plan, tenant: str) -> int:
    """Prompt (or recompute) tokens the plan computes for ``tenant``: every chunk but one-token decodes."""
    return sum(c.num_tokens for c in plan.chunks
               if c.seq.tenant == tenant and not (c.num_tokens == 1 and c.seq.output_token_ids))


def test_a_newcomers_first_token_shares_its_step_with_decodes_only():
    sched = Scheduler(config())
    for n in range(6):
        sched.add(make("flood", n, prompt=40, max_tokens=20))
    for _ in range(3):
        assert prefill_of(engine_step(sched), "flood") > 0
    light = make("light", 99, prompt=4, max_tokens=2)
    sched.add(light)
    plan = engine_step(sched)
    assert light.output_token_ids  # its first token, in the very next step
    assert prefill_of(plan, "flood") == 0
    assert any(c.seq.tenant == "flood" for c in plan.chunks)  # the flood's decodes still ran
    assert prefill_of(engine_step(sched), "flood") > 0  # and its prefill resumes at once


def test_a_tenant_with_a_backlog_gets_no_step_of_its_own():
    sched = Scheduler(config())
    for n in range(6):
        sched.add(make("flood", n, prompt=40, max_tokens=20))
    engine_step(sched)
    burst = [make("burst", 90 + n, prompt=4, max_tokens=2) for n in range(2)]
    for s in burst:
        sched.add(s)
    assert prefill_of(engine_step(sched), "flood") > 0


def test_a_floods_own_new_request_gets_no_step_of_its_own():
    sched = Scheduler(config())
    for n in range(4):
        sched.add(make("flood", n, prompt=8, max_tokens=30))
    for _ in range(2):
        engine_step(sched)  # all four decoding
    sched.add(make("other", 50, prompt=40, max_tokens=2))
    engine_step(sched)  # other's long prompt is under way
    sched.add(make("flood", 60, prompt=4, max_tokens=2))
    plan = engine_step(sched)
    assert prefill_of(plan, "flood") == 4 and prefill_of(plan, "other") > 0


def test_newcomers_every_step_still_leave_the_flood_every_other_step():
    sched = Scheduler(config())
    for n in range(40):
        sched.add(make("flood", n, prompt=40, max_tokens=1))  # more prefill than 40 steps can hold
    with_flood_prefill = 0
    for n in range(40):
        sched.add(make(f"t{n}", 100 + n, prompt=4, max_tokens=1))
        with_flood_prefill += prefill_of(engine_step(sched), "flood") > 0
    assert with_flood_prefill >= 19


def test_fcfs_and_tiered_without_fair_share_give_no_step_of_its_own():
    for cfg in (config(policy="fcfs"), config(fair_share=False)):
        sched = Scheduler(cfg)
        for n in range(6):
            sched.add(make("flood", n, prompt=40, max_tokens=20))
        engine_step(sched)
        sched.add(make("light", 99, prompt=4, max_tokens=2))
        assert prefill_of(engine_step(sched), "flood") > 0


def test_a_newcomer_takes_a_slot_from_the_tenant_holding_them_all():
    sched = Scheduler(config(max_num_seqs=4))
    flood = [make("flood", n, prompt=8, max_tokens=40) for n in range(8)]
    for s in flood:
        sched.add(s)
    for _ in range(3):
        engine_step(sched)
    light = make("light", 99, prompt=4, max_tokens=2)
    sched.add(light)
    plan = engine_step(sched)
    assert light.output_token_ids
    assert [s.tenant for s in plan.preempted] == ["flood"]
    assert plan.preempted[0] is flood[3]  # the latest admitted of the most served tenant


def test_a_fairness_preemption_never_takes_from_a_better_tier():
    sched = Scheduler(config(max_num_seqs=4))
    for n in range(4):
        sched.add(make("gold", n, prompt=8, max_tokens=40, tier="premium"))
    for _ in range(3):
        engine_step(sched)
    light = make("light", 99, prompt=4, max_tokens=2)
    sched.add(light)
    plan = engine_step(sched)
    assert not plan.preempted and not light.output_token_ids


# -- properties ---------------------------------------------------------------

requests = st.tuples(st.sampled_from(["a", "b", "c", "p"]), st.integers(1, 24), st.integers(1, 12))
patterns = st.lists(st.lists(requests, max_size=3), min_size=5, max_size=60)


@settings(max_examples=80, deadline=None)
@given(pattern=patterns, seqs=st.integers(1, 4), blocks=st.integers(20, 40))
# b-5 takes a-8's place; a's other sequences end, and a-8 (a now runs none) must not take b-5's back.
@example(pattern=[[("a", 1, 3), ("b", 18, 8), ("p", 1, 10)], [], [("a", 1, 6), ("b", 17, 9), ("b", 13, 5)],
                  [("a", 1, 7)], [("a", 1, 3), ("a", 9, 3)]], seqs=4, blocks=20)
def test_fairness_preemptions_stay_in_the_tier_and_never_swap_back(pattern, seqs, blocks):
    """Every preemption made for a waiting sequence of the same tier takes another tenant's sequence,
    and no sequence is ever preempted for one it was itself preempted for (no thrashing)."""
    cfg = config(max_num_seqs=seqs, num_blocks=blocks, max_model_len=40)
    sched = Scheduler(cfg, clock=lambda: 0.0)
    choose, swaps = sched.policy.victim_for_waiting, set()

    def spied(waiting, reason, running, frees_enough):
        victim = choose(waiting, reason, running, frees_enough)
        if victim is not None:
            assert sched.policy.priority[victim.tier] >= sched.policy.priority[waiting.tier]
            if victim.tier == waiting.tier:
                assert victim.tenant != waiting.tenant
                assert (victim.seq_id, waiting.seq_id) not in swaps, "thrashing"
                swaps.add((waiting.seq_id, victim.seq_id))
        return victim

    sched.policy.victim_for_waiting = spied
    ids = itertools.count()
    # Enough steps for one slot to run every request end to end, one token a step.
    drain = sum(prompt + max_tokens for arrivals in pattern for _, prompt, max_tokens in arrivals)
    for arrivals in pattern + [[]] * drain:
        for tenant, prompt, max_tokens in arrivals:
            sched.add(make(tenant, next(ids), prompt, max_tokens, "premium" if tenant == "p" else "standard"))
        engine_step(sched)
        sched.check_invariants()
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and sched.num_used_blocks == 0
