"""bench/live/hostile_bursts.py: each variant's burst is what it says, and the report's arithmetic."""

from __future__ import annotations

import json

from bench.live.hostile_bursts import BURST, PAD_CHARS, VARIANTS, burst, render_markdown, summarise


def test_each_burst_but_none_is_45_bodies_of_about_a_grammar_floods_size():
    assert burst("none", 0) == []
    sizes = {v: [len(json.dumps(body)) for _, body in burst(v, 0)] for v in VARIANTS if v != "none"}
    assert all(len(s) == BURST for s in sizes.values())
    flood = min(sizes["grammar_flood"])
    assert all(abs(size - flood) < 0.1 * flood for s in sizes.values() for size in s)
    assert all(len(body["user"]) == PAD_CHARS for _, body in burst("refused_62kb", 0))


def test_grammar_floods_of_two_reps_share_no_grammar_so_none_is_served_from_the_cache():
    def choices(rep: int) -> set[str]:
        return {json.dumps(body["structured_outputs"]) for _, body in burst("grammar_flood", rep)}

    assert len(choices(0)) == BURST and not choices(0) & choices(1)


def _run(ttft_s: float | None, cpu_s: float = 0.01, status: int = 200) -> dict:
    return {"ttft_s": ttft_s, "neighbour_status": status, "client_cpu_s": cpu_s, "statuses": {"429": 44, "200": 1}}


def test_each_variants_median_ttft_is_set_against_the_bursts_without_any():
    runs = {"none": [_run(0.03), _run(0.04), _run(0.05)],
            "grammar_flood": [_run(0.08), _run(0.1), _run(None, 0.02, 503)],
            "refused_62kb": [_run(0.06)], "unauthenticated_62kb": [_run(0.04)]}
    out = summarise(runs)
    assert abs(out["grammar_flood"]["ttft_median_s"] - 0.09) < 1e-9 and out["grammar_flood"]["ttft_max_s"] == 0.1
    assert abs(out["grammar_flood"]["ratio_to_none"] - 2.25) < 1e-9 and out["grammar_flood"]["neighbour_errors"] == 1
    assert out["grammar_flood"]["statuses"] == {"429": 132, "200": 3}
    assert abs(out["grammar_flood"]["client_cpu_ms_median"] - 10.0) < 1e-9
    table = render_markdown({"settings": {"reps": 3}, "variants": out})
    assert "| grammar_flood | 90.0 | 100.0 | 2.25x | 80.0, 100.0 |" in table
