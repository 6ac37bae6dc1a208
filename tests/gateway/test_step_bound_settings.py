"""The inter-token latency bound's settings reach the scheduler: TIERGATE_MAX_STEP_S, the premium TPOT SLO,
TIERGATE_STEP_BOUND_FACTOR and TIERGATE_MAX_PREFILL_STEP_S."""

from __future__ import annotations

import pytest

from gateway.server import engine_config
from gateway.settings import SettingsError, load_settings
from scheduler import SchedulerConfig


def scheduler_config(environ: dict[str, str]) -> SchedulerConfig:
    """The scheduler's config the settings from ``environ`` build."""
    return engine_config(load_settings(environ=environ)).scheduler_config(num_blocks=64, max_model_len=2048)


def scheduler_bounds(environ: dict[str, str]) -> tuple[float | None, float | None, float | None]:
    """(max_step_s, premium tpot_slo_s, standard tpot_slo_s) of the scheduler the settings build."""
    config = scheduler_config(environ)
    tpot = {t.name: t.tpot_slo_s for t in config.tiers}
    return config.max_step_s, tpot["premium"], tpot["standard"]


def test_the_bound_is_on_by_default_and_tighter_for_premium():
    assert scheduler_bounds({}) == (0.15, 0.1, None)  # this CPU
    assert scheduler_bounds({"TIERGATE_DEVICE": "cuda"}) == (0.05, 0.025, None)


def test_the_environment_sets_each_bound_and_zero_turns_it_off():
    assert scheduler_bounds({"TIERGATE_MAX_STEP_S": "0.3", "TIERGATE_PREMIUM_TPOT_SLO_S": "0.12"}) == (0.3, 0.12, None)
    assert scheduler_bounds({"TIERGATE_MAX_STEP_S": "0", "TIERGATE_PREMIUM_TPOT_SLO_S": "0"}) == (None, None, None)


@pytest.mark.parametrize("field, variable, cpu_default, value", [
    ("step_bound_factor", "TIERGATE_STEP_BOUND_FACTOR", 3.0, 4.0),  # a step beside streams: 3x their decodes alone
    ("max_prefill_step_s", "TIERGATE_MAX_PREFILL_STEP_S", 0.5, 1.5),  # a step with nobody decoding
])
def test_a_cpu_has_the_bound_by_default_a_gpu_none_and_the_environment_sets_it(field, variable, cpu_default, value):
    def bound(environ: dict[str, str]) -> float | None:
        return getattr(scheduler_config(environ), field)

    assert bound({}) == cpu_default
    assert bound({"TIERGATE_DEVICE": "cuda"}) is None
    assert bound({variable: str(value)}) == value
    assert bound({variable: "0"}) is None


@pytest.mark.parametrize("name, raw, message", [
    ("TIERGATE_STEP_BOUND_FACTOR", "1", "step_bound_factor"),
    ("TIERGATE_STEP_BOUND_FACTOR", "-2", "step_bound_factor"),
    ("TIERGATE_MAX_STEP_S", "-1", "max_step_s"),
    ("TIERGATE_MAX_STEP_S", "soon", "TIERGATE_MAX_STEP_S"),
    ("TIERGATE_PREMIUM_TPOT_SLO_S", "-0.5", "premium_tpot_slo_s"),
    ("TIERGATE_MAX_PREFILL_STEP_S", "-1", "max_prefill_step_s"),
])
def test_a_bound_that_is_not_a_duration_is_refused_by_name(name, raw, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={name: raw})
