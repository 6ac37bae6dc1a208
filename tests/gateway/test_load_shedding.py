"""Admission control: refusals by predicted TTFT against the SLO, bounded queues, standard shed first."""

from __future__ import annotations

from gateway.load_shedding import LoadShedder, SheddingPolicy
from scheduler.config import default_tiers
from scheduler.load import TierLoad


def load(premium_ttft=0.0, standard_ttft=0.0, premium_queue=0, standard_queue=0):
    return {
        "premium": TierLoad(premium_queue, 0, premium_ttft),
        "standard": TierLoad(standard_queue, 0, standard_ttft),
    }


def controller(**policy) -> LoadShedder:
    return LoadShedder(default_tiers(), SheddingPolicy(**policy))


def test_idle_engine_admits_everyone():
    c = controller()
    assert c.check("premium", load()) is None
    assert c.check("standard", load()) is None


def test_premium_over_its_slo_is_refused_with_drain_time():
    refusal = controller().check("premium", load(premium_ttft=2.5, premium_queue=3))
    assert refusal.reason == "slo"
    assert refusal.retry_after_s == 2.0  # 2.5 s predicted minus the 0.5 s SLO


def test_standard_is_shed_before_premium_misses_its_slo():
    c = controller(standard_shed_fraction=0.8)
    busy = load(premium_ttft=0.45, premium_queue=2)  # under premium's 0.5 s SLO, past 80 % of it
    assert c.check("premium", busy) is None
    assert c.check("standard", busy).reason == "slo"


def test_standard_wait_is_bounded_too():
    assert controller(standard_max_wait_s=10).check("standard", load(standard_ttft=11, standard_queue=1)).reason == "slo"


def test_without_a_backlog_a_slow_engine_still_admits():
    # One prefill on a slow CPU can exceed the SLO by itself; refusing would not make it faster.
    assert controller().check("premium", load(premium_ttft=0.9)) is None
    assert controller().check("standard", load(premium_ttft=0.9, standard_ttft=40)) is None


def test_queues_are_bounded_and_standard_bound_is_smaller():
    c = controller(max_queued=10, standard_queue_fraction=0.5)
    assert c.check("standard", load(standard_queue=5)).reason == "overload"
    assert c.check("premium", load(premium_queue=5)) is None
    assert c.check("premium", load(premium_queue=10)).reason == "overload"


def test_a_floods_backlog_does_not_shed_a_tenant_with_nothing_waiting():
    flooded = {"premium": TierLoad(0, 0, 0.0),
               "standard": TierLoad(30, 2, 40.0, newcomer_ttft_s=1.5, tenant_ttft_s={"flood": 40.0, "light": 3.0})}
    c = controller(standard_max_wait_s=30)
    assert c.check("standard", flooded, "flood").reason == "slo"
    assert c.check("standard", flooded, "light") is None  # its own queued work and its turns: 3 s
    assert c.check("standard", flooded, "newcomer") is None
    assert c.check("standard", flooded).reason == "slo"  # no tenant named: the tier's prediction


def test_without_fair_share_every_tenant_is_judged_by_the_tiers_backlog():
    fifo = {"premium": TierLoad(0, 0, 0.0), "standard": TierLoad(30, 2, 40.0)}
    assert controller(standard_max_wait_s=30).check("standard", fifo, "light").reason == "slo"


def test_a_tenant_filling_the_queue_sheds_itself_not_a_neighbour():
    """The queue bound is shared by the tenants waiting, counted in sequences (n choices count n)."""
    full = {"premium": TierLoad(0, 0, 0.0),
            "standard": TierLoad(96, 32, 5.0, newcomer_ttft_s=1.0, tenant_ttft_s={"flood": 5.0, "light": 1.0},
                                 tenant_waiting={"flood": 90, "light": 6})}
    c = controller(max_queued=128, standard_queue_fraction=0.5)  # standard's bound: 64
    assert c.check("standard", full, "flood").reason == "overload"
    assert c.check("standard", full, "light") is None
    assert c.check("standard", full, "newcomer") is None
    past_hard = {**full, "standard": TierLoad(128, 32, 5.0, newcomer_ttft_s=1.0, tenant_waiting={"flood": 128})}
    assert c.check("standard", past_hard, "newcomer").reason == "overload"


def test_batch_is_refused_only_for_a_full_queue_never_for_latency_or_premiums_backlog():
    c = controller(max_queued=10)
    busy = {**load(premium_ttft=0.45, premium_queue=2), "batch": TierLoad(4, 8, 1e4)}
    assert c.check("batch", busy) is None  # a batch line waits for idle steps by design
    assert c.check("batch", {**busy, "batch": TierLoad(5, 8, 1e4)}).reason == "overload"
