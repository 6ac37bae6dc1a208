"""The real-engine long-prompt bench's parts: switching the bound between rounds, and its report."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from bench.offline import long_prompts
from scheduler import Scheduler, SchedulerConfig, Sequence
from scheduler.step_budget import step_target_s


def test_switching_the_bound_sets_and_clears_every_target():
    engine = SimpleNamespace(scheduler=Scheduler(SchedulerConfig(num_blocks=64)))
    premium, standard = (Sequence(f"{tier}-0", [1, 2, 3], tier=tier) for tier in ("premium", "standard"))

    long_prompts._bound(engine, "seconds")
    assert step_target_s(engine.scheduler.config, [standard]) == long_prompts.ON["max_step_s"]
    assert step_target_s(engine.scheduler.config, [premium, standard]) == long_prompts.ON["premium_tpot_slo_s"]
    assert engine.scheduler.config.step_bound_factor is None
    assert engine.scheduler.config.max_prefill_step_s is None
    long_prompts._bound(engine, "streams")
    assert engine.scheduler.config.step_bound_factor == long_prompts.ON["step_bound_factor"]
    assert engine.scheduler.config.max_prefill_step_s is None
    long_prompts._bound(engine, "on")
    assert step_target_s(engine.scheduler.config, [premium, standard]) == long_prompts.ON["premium_tpot_slo_s"]
    assert engine.scheduler.config.step_bound_factor == long_prompts.ON["step_bound_factor"]
    assert engine.scheduler.config.max_prefill_step_s == long_prompts.ON["max_prefill_step_s"] == 0.5
    long_prompts._bound(engine, "off")
    assert step_target_s(engine.scheduler.config, [premium, standard]) is None
    assert engine.scheduler.config.step_bound_factor is None
    assert engine.scheduler.config.max_prefill_step_s is None


def test_the_report_has_a_row_per_mode_from_the_gaps_and_ttfts_measured():
    phase = {"neighbour_ttft_s": [0.2, 0.4], "neighbour_gaps_s": [0.05, 0.1, 0.3], "long_ttft_s": [2.0],
             "tokens": 2151, "wall_s": 10.0, "busy_s": 9.0}
    result = {"settings": {"rounds": 1, "alone_s": 6.0, "round_s": 20.0, "long_every_s": 4.0,
                           "long_prompt_tokens": 1987, "bound": long_prompts.ON},
              "step_cost_fit": {},
              "summary": {m: long_prompts._summary([phase]) for m in ("alone", *long_prompts.MODES)}}

    summary = result["summary"]["on"]
    assert summary["neighbour_gap_max_s"] == 0.3 and summary["gaps"] == 3 and summary["busy_share"] == 0.9
    assert summary["tokens_per_s"] == 215.1
    lines = long_prompts.render_markdown(result).splitlines()
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "mode" not in line] == \
        ["alone", "off", "seconds", "streams", "on"]
    assert "| 300 |" not in lines[-1] and "/ 300 |" in lines[-1] and "| 215 |" in lines[-1]


def test_every_long_prompt_of_a_run_is_new_to_the_prefix_cache():
    """Phases send long prompts in turn; one repeated from an earlier phase would be served from the cache."""
    engine = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: [ord(c) for c in text]))
    prompts = list(itertools.islice(long_prompts._long_prompts(engine), 40))
    assert all(len(p) == long_prompts.LONG_PROMPT for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 40  # each its own from its first block
