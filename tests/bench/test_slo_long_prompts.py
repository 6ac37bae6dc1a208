"""The long-prompt SLO scenario: on the virtual clock the bound brings premium's inter-token gaps under target."""

from __future__ import annotations

import json

from bench.sim import long_prompts
from bench.sim.slo import CostModel


def test_with_the_bound_premium_gaps_fall_under_the_target_and_without_it_they_do_not():
    result = long_prompts.run(CostModel(), long_prompts.GPU, num_requests=60, seed=0)

    for row in result["rows"]:
        off, on = row["off"]["premium"], row["on"]["premium"]
        assert off["gap_p99_s"] > 2 * result["premium_tpot_slo_s"]  # a long prompt's chunk in the step
        assert on["gap_p99_s"] <= result["premium_tpot_slo_s"]
        assert row["on"]["standard"]["gap_max_s"] <= result["max_step_s"]
    assert {g["goal"].split(":")[0] for g in result["goals"]} >= {"0.5x", "0.8x"}
    assert 0.5 < result["capacity_tokens_per_s"]["on"] / result["capacity_tokens_per_s"]["off"] <= 1.0


def test_the_cli_reports_every_goal_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "slp.json"
    status = long_prompts.main(["--requests", "30", "--json", str(out)])

    result = json.loads(out.read_text())
    goals = [g for r in result["runs"].values() for g in r["goals"]]
    assert status == (0 if all(g["met"] for g in goals) else 1)
    printed = capsys.readouterr().out
    assert printed.count("[MET]") + printed.count("[MISSED]") == len(goals) and "| 0.8x" in printed
