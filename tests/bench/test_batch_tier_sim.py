"""The batch tier on the virtual clock (bench/sim/batch_tier.py): what the scheduler decides, without the live
bench's noise."""

import pytest

from bench.sim.batch_tier import CPU_COST, Workload, render_markdown, run


@pytest.fixture(scope="module")
def result() -> dict:
    return run([0.2], CPU_COST, Workload.of_live_bench(), duration_s=60.0, seeds=1)


def test_a_request_arriving_in_a_step_of_batch_work_alone_runs_between_its_layers(result):
    beside = result["rows"][0]["beside"]
    assert beside["arrivals_in_batch_steps"] > 0
    assert beside["waited_for_batch_step"] == 0


def test_the_batch_adds_tokens_and_leaves_interactive_first_tokens_about_where_they_were(result):
    ratios = result["rows"][0]["ratios"]
    assert ratios["tokens"] > 1.05
    assert result["rows"][0]["beside"]["batch_tokens_per_s"] > 0
    for tier in ("premium", "standard"):
        assert ratios[f"ttft_p50_{tier}"] < 1.25


def test_the_same_interactive_requests_arrive_alone_and_beside_the_batch(result):
    alone, beside = result["rows"][0]["alone"], result["rows"][0]["beside"]
    assert alone["batch_tokens_per_s"] == 0
    assert alone["interactive_requests"] == beside["interactive_requests"] > 0


def test_the_report_has_a_row_per_share_and_seed(result):
    assert "| 0.2 | 0 |" in render_markdown(result)
