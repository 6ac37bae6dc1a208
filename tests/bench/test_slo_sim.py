"""The SLO simulation: the real scheduler on a virtual clock, and how it scales SLOs to a slower machine."""

from dataclasses import replace

from bench.sim.slo import CostModel, SimSettings, run, slo_scale

SMALL = SimSettings(num_requests=60, num_blocks=2048)


def test_gpu_coefficients_keep_the_stated_slos():
    assert slo_scale(SMALL, CostModel()) == {"factor": 1.0}


def test_a_machine_ten_times_slower_gets_slos_about_ten_times_longer():
    gpu = CostModel()
    slow = CostModel(*(10 * v for v in (gpu.base_s, gpu.per_prefill_token_s, gpu.per_decode_seq_s,
                                        gpu.per_context_token_s)))
    assert 9.0 < slo_scale(SMALL, slow)["factor"] < 11.0


def test_tiered_serves_premium_first_where_fcfs_queues_it():
    result = run(replace(SMALL, num_requests=200), CostModel(), loads=(2.0,))
    row = result["rows"][0]
    assert row["tiered"]["premium"]["ttft_p99_s"] < row["fcfs"]["premium"]["ttft_p99_s"]
    assert row["tiered"]["premium"]["ttft_p99_s"] <= SMALL.premium_slo_s
    assert [g["goal"] for g in result["goals"]][0].startswith("2x load")
