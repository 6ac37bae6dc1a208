"""bench/live/hostile.py's report arithmetic: the neighbour's figures and its pooled baseline, ratios to the
baseline, 5xx, rows per request, the goals over attacks; and the attacks' bodies round by round."""

from __future__ import annotations

import json

from bench.live.hostile import phase_report, render_markdown, summarise
from bench.live.hostile_neighbour import Sample, baseline_stats, neighbour_stats
from bench.live.hostile_attacks import attacks


def _baseline(engine_share: float = 0.2) -> dict:
    return {**baseline_stats([Sample(200, 0.1, 0.04)] * 5, [Sample(200, 0.1, 0.04)] * 5), "engine_share": engine_share}


def test_the_baseline_pools_the_neighbour_alone_before_and_after_the_attacks():
    before, after = [Sample(200, 0.1, 0.01)] * 50, [Sample(200, 0.1, 0.03)] * 49 + [Sample(200, 0.9, 0.02)]
    baseline = baseline_stats(before, after)
    assert baseline["served"] == 100 and baseline["max_gap_s"] == 0.03
    assert baseline["before"]["ttft_p99_s"] == 0.1 and abs(baseline["after"]["ttft_p99_s"] - 0.508) < 1e-9
    assert abs(baseline["ttft_p99_s"] - 0.108) < 1e-9  # one slow first token of 100 is the pooled p99's, not all of it


def test_neighbour_stats_take_the_served_requests_ttft_percentiles_and_the_largest_gap():
    stats = neighbour_stats([Sample(200, 0.1, 0.02), Sample(200, 0.3, 0.05), Sample(429), Sample("ReadTimeout")])
    assert stats["sent"] == 4 and stats["served"] == 2
    assert abs(stats["ttft_p99_s"] - 0.298) < 1e-9 and stats["ttft_max_s"] == 0.3 and stats["max_gap_s"] == 0.05
    assert stats["errors"] == {"429": 1, "ReadTimeout": 1}


def test_an_attack_is_measured_against_the_baseline_and_its_rows_against_its_requests():
    neighbour = neighbour_stats([Sample(200, 0.15, 0.1), Sample(503)])
    outcomes = [{"status": 400, "bad_tool_calls": 0}, {"status": 500, "bad_tool_calls": 0},
                {"status": 200, "bad_tool_calls": 1}]
    report = phase_report("x", _baseline(), neighbour, outcomes, (3, 2, 3))
    assert abs(report["ttft_p99_ratio"] - 1.5) < 1e-9 and abs(report["max_gap_ratio"] - 2.5) < 1e-9
    assert report["five_xx"] == 2  # the attack's 500 and the neighbour's 503
    assert report["met"] == {"neighbour_ttft_p99_within_2x": True, "neighbour_max_gap_within_2x": False,
                             "no_5xx": False, "one_row_per_request": False, "tool_calls_json": False}
    assert phase_report("x", _baseline(), neighbour_stats([]), outcomes, (3, 3, 3))["met"][
        "neighbour_ttft_p99_within_2x"] is False  # nothing served beside it is no pass


def test_the_goals_name_the_attacks_that_missed_them_and_the_end_rss():
    good = phase_report("calm", _baseline(), _baseline(), [{"status": 200, "bad_tool_calls": 0}], (1, 1, 1))
    slow = phase_report("slow", _baseline(), neighbour_stats([Sample(200, 0.5, 0.04)]),
                        [{"status": 200, "bad_tool_calls": 0}], (1, 1, 1), attack_s=2.5)
    measured = {"baseline": _baseline(), "rounds": [{"phases": [good, slow], "rss_mb": 900.0}], "rss_start_mb": 800.0,
                "neighbour_sent": 12}
    result = summarise(measured, [800.0, 1700.0, 1400.0], 1400.0, 12)
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["neighbour ttft p99 within 2x for every attack"]["missed_by"] == ["slow"]
    assert goals["no 5xx for every attack"]["met"] and goals["one ledger row per neighbour request"]["met"]
    assert goals["server RSS under 1536 MB at the end"]["met"] and result["rss_peak_mb"] == 1700.0
    assert not summarise(measured, [1600.0], 1600.0, 11)["goals"][-2]["met"]
    text = _render(result)
    assert "| 1 | slow | 1, 2.5 |" in text and "5.0x (0.500)" in text
    assert "[MISSED] neighbour ttft p99 within 2x for every attack (missed: slow)" in text
    assert "20% of the engine's time" in text and "overload" not in text


def test_a_neighbour_that_alone_took_over_half_the_engine_is_reported_as_overload_not_isolation():
    good = phase_report("calm", _baseline(0.7), _baseline(0.7), [{"status": 200, "bad_tool_calls": 0}], (1, 1, 1))
    measured = {"baseline": _baseline(0.7), "rounds": [{"phases": [good], "rss_mb": 900.0}], "rss_start_mb": 800.0,
                "neighbour_sent": 10}
    text = _render(summarise(measured, [900.0], 900.0, 10))
    assert "70% of the engine's time" in text and "what is measured is overload, not isolation" in text


def _render(result: dict) -> str:
    return render_markdown({**result, "machine": {"date": "d", "cpu": "c", "cores": 2, "ram_gb": 1, "load_average": [0],
                                                  "versions": {}},
                            "settings": {"baseline_s": 1, "attack_timeout_s": 1, "window_s": 1, "rounds": 1,
                                         "neighbour_every_s": 0.25}})


def test_each_rounds_attacks_are_their_own_so_no_cache_serves_a_later_round():
    rounds = [{a.name: [json.dumps(body, sort_keys=True) for _, body in a.bodies] for a in attacks(r)} for r in range(3)]

    for name in ("grammar_flood", "huge_choice", "large_ebnf", "prompt_logprobs_n16", "long_prompt"):
        assert not set(rounds[0][name]) & set(rounds[1][name]), name
    prompts = [json.loads(body)["prompt"] for bodies in rounds for body in bodies["long_prompt"]]
    # The prefix cache matches whole blocks from the first token on: the prompts differ in their first words.
    assert len({p.split(" ")[0] for p in prompts}) == len(prompts) == 9
