"""The speculative decoding bench's report: each goal judged on the median of its rounds' on/off ratios."""

from __future__ import annotations

from bench.offline.spec_decode import Run, _entry, goals, render_markdown


def _result(copying8_pairs: list[float], open1_pairs: list[float]) -> dict:
    run = Run(10.0, 1000)
    return {"tiergate": {"copying@1": _entry(run, Run(4.0, 1000), [2.5, 2.4]),
                         "copying@8": _entry(run, run, copying8_pairs),
                         "open@1": _entry(run, run, open1_pairs)},
            "llama_cpp": {"copying@1": _entry(run, Run(8.0, 1000), [1.25])},
            "loadavg_before": ["0.1"], "loadavg_after": ["0.2"]}


def test_a_goal_is_judged_on_the_median_of_the_rounds_so_one_slow_round_does_not_decide_it():
    judged = dict(goals(_result([1.35, 0.9, 1.32, 1.4], [0.97, 0.7, 1.0])))
    assert judged["copying, 8 streams: on >= 1.3x off"]
    assert judged["open, 1 streams: on >= 0.95x off"]
    assert judged["copying, one stream: on >= 2.0x off"]
    assert judged["copying, one stream: on >= 1.0x llama.cpp's lookup"]


def test_a_goal_missed_in_most_rounds_is_missed():
    judged = dict(goals(_result([1.2, 1.4, 1.25], [0.9, 0.93, 1.2])))
    assert not judged["copying, 8 streams: on >= 1.3x off"]
    assert not judged["open, 1 streams: on >= 0.95x off"]


def test_the_section_shows_every_round_and_the_goals():
    text = render_markdown(_result([1.35, 1.2], [1.0, 0.96]))
    assert "1.275x (1.35, 1.2)" in text
    assert "- [MISSED] copying, 8 streams: on >= 1.3x off" in text
    assert "- [MET] open, 1 streams: on >= 0.95x off" in text
