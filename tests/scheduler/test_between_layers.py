"""Express steps between layers: a light tenant's short request planned while another step is under way.

``Scheduler.schedule_express`` runs while the plan of the step under way is
being computed, so it may admit only what leaves that plan intact: no chunk for a
running sequence, no preemption, no adapter the step does not already hold.
"""

from __future__ import annotations

import pytest

from scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan
from scheduler.config import StepCost, TierConfig
from scheduler.plan import StepFeatures

from scheduler_driver import engine_step, fake_token


def standard_only() -> tuple[TierConfig, ...]:
    """The two tiers with no premium KV reserve: standard may fill the pool."""
    return (TierConfig("premium", priority=0, ttft_slo_s=None), TierConfig("standard", priority=1, ttft_slo_s=None))


def config(**kw) -> SchedulerConfig:
    base = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                standard_min_share=0.0)
    return SchedulerConfig(**{**base, **kw})


def make(tenant: str, n: int, prompt: int, max_tokens: int, adapter: str | None = None) -> Sequence:
    return Sequence(f"{tenant}-{n}", [(n * 31 + i) % 500 for i in range(prompt)], tier="standard", tenant=tenant,
                    max_tokens=max_tokens, adapter=adapter)


def flood_under_way(sched: Scheduler, requests: int = 6, prompt: int = 40, steps: int = 3) -> StepPlan:
    """A flood of long prompts, ``steps`` steps in; returns the plan of the step now under way (not applied yet)."""
    for n in range(requests):
        sched.add(make("flood", n, prompt=prompt, max_tokens=20))
    for _ in range(steps):
        engine_step(sched)
    return sched.schedule()


def snapshot(plan: StepPlan) -> list[tuple]:
    return [(c.seq.seq_id, c.start, c.num_tokens, tuple(c.seq.block_table), c.seq.status) for c in plan.chunks]


def apply(sched: Scheduler, plan: StepPlan) -> None:
    sched.update(plan, {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples})


def test_a_light_request_is_planned_whole_and_the_step_under_way_is_left_as_it_was():
    sched = Scheduler(config())
    under_way = flood_under_way(sched)
    before = snapshot(under_way)
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)

    express = sched.schedule_express(frozenset())

    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in express.chunks] == [(light, 0, 6, True)]
    assert not express.preempted
    assert snapshot(under_way) == before
    held = {b for c in under_way.chunks for b in c.seq.block_table}
    assert held.isdisjoint(light.block_table)
    # Both apply, the express step first (it ends first), and the books stay straight.
    apply(sched, express)
    apply(sched, under_way)
    sched.check_invariants()
    assert len(light.output_token_ids) == 1


def test_nobody_is_preempted_to_make_room_between_layers():
    # 30 blocks: standard's 70% (21, 84 tokens) is all held by the flood after three steps of 32 tokens,
    # so the light request would need a preemption.
    sched = Scheduler(config(num_blocks=30))
    under_way = flood_under_way(sched)
    before = snapshot(under_way)
    sched.add(make("light", 99, prompt=6, max_tokens=3))

    express = sched.schedule_express(frozenset())

    assert express.is_empty and snapshot(under_way) == before


def test_an_adapter_the_step_under_way_does_not_hold_waits_for_its_end():
    sched = Scheduler(config())
    flood_under_way(sched)
    light = make("light", 99, prompt=6, max_tokens=3, adapter="sql")
    sched.add(light)

    assert sched.schedule_express(frozenset({"chat"})).is_empty
    assert [c.seq for c in sched.schedule_express(frozenset({"chat", "sql"})).chunks] == [light]


@pytest.mark.parametrize("who", ["flood", "burst"])
def test_a_backlog_never_goes_between_layers(who):
    sched = Scheduler(config())
    flood_under_way(sched)
    for n in range(2):  # the flood's own new requests, or a second tenant's burst of two
        sched.add(make(who, 90 + n, prompt=6, max_tokens=3))

    assert sched.schedule_express(frozenset()).is_empty


@pytest.mark.parametrize("policy, fair", [("fcfs", True), ("tiered", False)])
def test_without_fair_share_nothing_goes_between_layers(policy, fair):
    sched = Scheduler(config(policy=policy, fair_share=fair))
    flood_under_way(sched)
    sched.add(make("light", 99, prompt=6, max_tokens=3))

    assert sched.schedule_express(frozenset()).is_empty


def test_beside_one_long_prompt_a_neighbours_short_request_goes_between_layers():
    """One tenant prefilling a prompt of several steps runs a single sequence, yet its step-sized chunks would
    make a neighbour's short request wait a whole step: the neighbour goes between layers."""
    sched = Scheduler(config(max_model_len=256))
    long = make("long", 0, prompt=200, max_tokens=2)  # 32-token steps: about six of them
    sched.add(long)
    engine_step(sched)
    under_way = sched.schedule()
    before = snapshot(under_way)
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)

    assert [c.seq for c in sched.schedule_express(frozenset()).chunks] == [light]
    assert snapshot(under_way) == before


def test_beside_a_stream_decoding_between_its_layers_a_newcomers_whole_prompt_goes_there_under_its_tiers_bound():
    """A long prompt's step with nobody decoding in it, a light tenant's first request started and decoding between
    its layers. The tenant's next request goes between the layers too, whole, though it costs more than
    ``step_bound_factor`` times that stream's decode alone: that tighter bound kept it out, and it waited for the
    whole long step (the hostile bench's long prompt: a neighbour's first tokens at 0.6-0.9 s against 0.04 s)."""
    cost = StepCost(base_s=0.008, per_prefill_token_s=0.0014, per_decode_seq_s=0.0002)
    sched = Scheduler(config(max_model_len=256, max_step_s=0.15, step_bound_factor=3.0, step_cost_prior=cost))
    sched.add(make("long", 0, prompt=200, max_tokens=2))
    engine_step(sched)
    under_way = sched.schedule()
    inside = frozenset(c.seq.seq_id for c in under_way.chunks)
    first = make("light", 1, prompt=6, max_tokens=8)
    sched.add(first)
    apply(sched, sched.schedule_express(frozenset(), inside))
    assert first.output_token_ids  # it decodes now, between the layers of the step under way
    second = make("light", 2, prompt=12, max_tokens=8)  # 8 + 12 * 1.4 ms > 0.95 * 3 * its decode's 8.2 ms
    sched.add(second)

    assert [c.seq for c in sched.schedule_express(frozenset(), inside).chunks] == [second]


@pytest.mark.parametrize("scored", [True, False])
def test_beside_a_prompt_whose_scores_make_its_one_step_long_a_neighbours_short_request_goes_between_layers(scored):
    """A prompt that fits in one step's tokens, but whose rows are scored for prompt logprobs: the LM head
    over the whole vocabulary for each of them makes that one step long, and a neighbour's request waits for
    all of it unless it goes between layers. Unscored, the same prompt makes a short step."""
    costly_scores = StepCost(per_scored_row_s=0.02)
    sched = Scheduler(config(max_model_len=256, max_step_s=0.5, step_cost_prior=costly_scores))
    prompt = make("scorer", 0, prompt=30, max_tokens=1)  # 30 tokens: under a step's 32
    prompt.reads_prefix_cache = not scored
    sched.add(prompt)
    under_way = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in under_way.chunks] == [(prompt, 30)]
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)

    express = [c.seq for c in sched.schedule_express(frozenset(), {prompt.seq_id}).chunks]
    assert express == ([light] if scored else [])


def test_beside_an_admitted_requests_choices_waiting_to_join_it_a_neighbours_request_goes_first():
    """The n - 1 later choices of an admitted request join it ahead of everything queued: beside them a
    neighbour's lone request waits as beside a flood of that many, so it qualifies as beside one."""
    sched = Scheduler(config(max_model_len=256))
    prompt = [(7 * i) % 500 for i in range(30)]
    choices = [Sequence(f"big#{i}", list(prompt), tier="standard", tenant="big", max_tokens=2, group="big")
               for i in range(8)]
    sched.add(choices[0])
    engine_step(sched)  # the first choice's prompt is computed; its siblings join it now, as the engine adds them
    for sibling in choices[1:]:
        sched.add(sibling, sibling_of=choices[0].seq_id)
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)

    planned = {c.seq.seq_id for c in sched.schedule().chunks}
    assert light.seq_id in planned and choices[0].seq_id in planned  # the neighbour and the first choice's decode
    assert not planned & {s.seq_id for s in choices[1:]}  # the joining choices held for this one step


def test_the_long_prompts_own_tenant_and_its_last_step_get_no_express_step():
    sched = Scheduler(config(max_model_len=256))
    long = make("long", 0, prompt=40, max_tokens=2)  # 40 tokens: 8 left after one step, under a step's 32
    sched.add(long)
    engine_step(sched)
    sched.schedule()
    sched.add(make("light", 99, prompt=6, max_tokens=3))
    sched.add(make("long", 1, prompt=6, max_tokens=3))  # the long prompt's tenant: busy prefilling

    assert sched.schedule_express(frozenset()).is_empty


def test_a_prompt_longer_than_a_step_waits_for_the_step_end():
    sched = Scheduler(config())
    flood_under_way(sched)
    sched.add(make("light", 99, prompt=33, max_tokens=3))  # the budget is 32 tokens

    assert sched.schedule_express(frozenset()).is_empty


@pytest.mark.parametrize("spare", [0, 3])
def test_admissions_beside_running_sequences_leave_the_spare_blocks_free(spare):
    # 20 blocks of 4 tokens, no premium reserve. Two running requests hold 12 of them once their
    # first decodes are planned; the next one needs 7, which would leave 1: with 3 spare it waits,
    # and the spare is there for a light request arriving during the step.
    sched = Scheduler(config(num_blocks=20, max_num_batched_tokens=64, express_spare_blocks=spare,
                             tiers=standard_only()))
    running = [make("flood", n, prompt=20, max_tokens=20) for n in (1, 2)]
    for seq in running:
        sched.add(seq)
    engine_step(sched)
    next_one = make("flood", 3, prompt=28, max_tokens=4)
    sched.add(next_one)
    under_way = sched.schedule()

    assert [len(seq.block_table) for seq in running] == [6, 6]
    assert (next_one in [c.seq for c in under_way.chunks]) == (spare == 0)
    light = make("light", 99, prompt=5, max_tokens=2)  # 2 blocks
    sched.add(light)
    assert [c.seq for c in sched.schedule_express(frozenset()).chunks] == ([light] if spare else [])


def test_a_request_that_needs_the_whole_pool_starts_when_nothing_else_runs():
    sched = Scheduler(config(num_blocks=16, max_model_len=64, express_spare_blocks=4, tiers=standard_only()))
    whole = make("big", 1, prompt=60, max_tokens=4)  # 64 tokens: all 16 blocks
    sched.add(whole)
    for _ in range(8):
        engine_step(sched)
    assert whole.output_token_ids


def _light_started_under_way(sched: Scheduler) -> tuple[StepPlan, Sequence, list[tuple]]:
    """A flood's step under way, and a light request whose express step ran inside it (applied)."""
    under_way = flood_under_way(sched)
    before = snapshot(under_way)
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)
    apply(sched, sched.schedule_express(frozenset()))
    return under_way, light, before


def test_a_request_started_between_layers_decodes_there_once_its_wait_nears_the_step_bound():
    sched = Scheduler(config(max_step_s=0.1))
    under_way, light, before = _light_started_under_way(sched)
    inside = frozenset(c.seq.seq_id for c in under_way.chunks)

    assert sched.schedule_express_decodes(inside, waited_s=0.01).is_empty  # its gap is still short
    decodes = sched.schedule_express_decodes(inside, waited_s=0.1)

    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in decodes.chunks] == [(light, 6, 1, True)]
    assert not decodes.preempted and snapshot(under_way) == before
    apply(sched, decodes)
    apply(sched, under_way)
    sched.check_invariants()
    assert len(light.output_token_ids) == 2


def test_a_decode_between_layers_comes_before_the_bound_when_the_next_chance_to_ask_would_come_after_it():
    sched = Scheduler(config(max_step_s=0.1))
    under_way, light, _ = _light_started_under_way(sched)
    inside = frozenset(c.seq.seq_id for c in under_way.chunks)
    # 60 ms waited: with the next layer boundary 5 ms away there is time to ask again ...
    assert sched.schedule_express_decodes(inside, waited_s=0.06, next_chance_s=0.005).is_empty
    # ... but not with it 40 ms away: that token would come after the bound, so it goes now.
    decodes = sched.schedule_express_decodes(inside, waited_s=0.06, next_chance_s=0.04)
    assert [(c.seq, c.num_tokens) for c in decodes.chunks] == [(light, 1)]


def test_without_a_step_bound_nothing_decodes_between_layers():
    sched = Scheduler(config())  # no max_step_s and no tier's TPOT SLO: a step may last as long as it takes
    under_way, _, _ = _light_started_under_way(sched)

    assert sched.schedule_express_decodes(frozenset(c.seq.seq_id for c in under_way.chunks), 10.0).is_empty


def test_a_decode_between_layers_never_preempts_for_its_next_block():
    sched = Scheduler(config(max_step_s=0.1, tiers=standard_only()))
    under_way = flood_under_way(sched)
    before = snapshot(under_way)
    light = make("light", 99, prompt=8, max_tokens=3)  # two whole blocks: its next token needs a third
    sched.add(light)
    apply(sched, sched.schedule_express(frozenset()))
    taker = make("taker", 7, prompt=4, max_tokens=1)  # holds every free block, as neighbours could
    sched.block_manager.allocate(taker, sched.config.block_size * sched.block_manager.num_free_blocks)

    decodes = sched.schedule_express_decodes(frozenset(c.seq.seq_id for c in under_way.chunks), waited_s=0.1)

    assert decodes.is_empty and snapshot(under_way) == before and light in sched.running


def test_a_plan_under_a_time_bound_says_how_much_slower_it_may_run_within_it():
    sched = Scheduler(config(max_step_s=0.1))
    decoding = make("stream", 1, prompt=6, max_tokens=20)
    sched.add(decoding)
    apply(sched, sched.schedule())  # its prompt: nobody decodes, so no bound
    sched.add(make("long", 2, prompt=60, max_tokens=2))

    plan = sched.schedule()  # its decode beside the long prompt's chunk, cut to the bound

    predicted = sched.step_cost.predict(sum((StepFeatures.of(c) for c in plan.chunks), StepFeatures()))
    assert plan.bound_slack == pytest.approx(0.1 / predicted)
    assert Scheduler(config()).schedule().bound_slack is None


def _premium(n: int, prompt: int = 6, tenant: str | None = None) -> Sequence:
    return Sequence(f"premium-{n}", [(n * 17 + i) % 500 for i in range(prompt)], tier="premium",
                    tenant=tenant or f"p{n}", max_tokens=3)


def test_inside_a_step_of_only_standard_work_premium_requests_go_between_layers_in_order():
    sched = Scheduler(config(max_model_len=256))
    long = make("long", 0, prompt=200, max_tokens=2)  # one standard tenant: no express rule of its tier applies
    sched.add(long)
    engine_step(sched)
    under_way = sched.schedule()
    before = snapshot(under_way)
    first, second, too_long = _premium(1), _premium(2), _premium(3, prompt=100)
    for seq in (first, second, too_long):
        sched.add(seq)

    express = sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks))

    assert [(c.seq, c.start, c.num_tokens) for c in express.chunks] == [(first, 0, 6), (second, 0, 6)]
    assert snapshot(under_way) == before and not express.preempted


def test_a_premium_request_waits_for_a_step_that_holds_premium_work():
    sched = Scheduler(config(max_model_len=256))
    sched.add(_premium(0, prompt=200))
    engine_step(sched)
    under_way = sched.schedule()
    sched.add(_premium(1, tenant="p0"))  # the long prompt's own tenant: no express rule of its tier applies

    assert sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks)).is_empty


def test_a_preempted_premium_request_goes_between_layers_only_with_its_outputs_whole():
    sched = Scheduler(config(max_model_len=256))
    long = make("long", 0, prompt=200, max_tokens=2)
    sched.add(long)
    engine_step(sched)
    under_way = sched.schedule()
    preempted = _premium(1, prompt=6)
    preempted.output_token_ids.extend(range(40))  # back in the queue: 46 tokens to recompute, over the step's 32
    sched.add(preempted)

    express = sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks))

    assert express.is_empty  # not a partial chunk of it between the layers


def _stream_beside_a_long_prompt(sched: Scheduler) -> tuple[StepPlan, Sequence]:
    """A standard tenant's stream decoding in the step under way beside another's long prompt chunk."""
    stream = make("stream", 1, prompt=6, max_tokens=20)
    sched.add(stream)
    apply(sched, sched.schedule())  # its prompt: it decodes from the next step on
    sched.add(make("long", 0, prompt=200, max_tokens=2))
    under_way = sched.schedule()
    assert {c.seq.seq_id: c.is_decode for c in under_way.chunks}[stream.seq_id]
    return under_way, stream


def test_a_step_that_decodes_a_stream_gets_no_express_step_of_its_tier_between_its_layers():
    """The step was planned to its stream's bound: a newcomer of the same tier waits for its end (and starts
    first in the next step) rather than delay the stream's next token by an express step inside it."""
    sched = Scheduler(config(max_model_len=256, max_step_s=0.1))
    under_way, stream = _stream_beside_a_long_prompt(sched)
    light = make("light", 99, prompt=6, max_tokens=3)
    sched.add(light)

    assert sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks)).is_empty
    apply(sched, under_way)
    assert light.seq_id in {c.seq.seq_id for c in sched.schedule().chunks}  # first in the next step
    # Before any step is under way (nothing decodes inside one), the same request is express.
    other = Scheduler(config(max_model_len=256, max_step_s=0.1))
    _stream_beside_a_long_prompt(other)
    other.add(make("light", 98, prompt=6, max_tokens=3))
    assert not other.schedule_express(frozenset()).is_empty


def test_a_premium_request_still_goes_between_the_layers_of_a_step_of_standard_streams():
    sched = Scheduler(config(max_model_len=256, max_step_s=0.1))
    under_way, _ = _stream_beside_a_long_prompt(sched)
    premium = _premium(1)
    sched.add(premium)

    express = sched.schedule_express(frozenset(), frozenset(c.seq.seq_id for c in under_way.chunks))

    assert [c.seq for c in express.chunks] == [premium]
