"""bench/live/chaos.py's report: one table row per fault, and totals held against the goals."""

from __future__ import annotations

from dataclasses import asdict

from bench.live.chaos import GOALS, PhaseResult, render_markdown


def test_the_report_has_a_row_per_fault_and_totals_the_goal_columns():
    phases = [PhaseResult("database cut", sent=10, answered={"200": 9, "503": 1}),
              PhaseResult("server SIGKILLed and restarted", sent=5, answered={"200": 3, "500": 1},
                          non_503_5xx=1, connection_errors=1, rows_missing=2, interrupted_rows=1)]
    text = render_markdown({"concurrency": 2, "phase_s": 1.0, "wall_s": 3.0, "goals": GOALS,
                            "phases": [asdict(p) for p in phases]})
    assert "| database cut | 10 | 200: 9, 503: 1 | 0 |" in text
    assert "| server SIGKILLed and restarted | 5 | 200: 3, 500: 1 | 1 | 1 | 0 | 2 | 0 | 0 | 1 |" in text
    assert "non 503 5xx 1 (goal 0)" in text and "rows missing 2 (goal 0)" in text
