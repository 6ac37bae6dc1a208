"""The CPU thread count follows measured step times, and an env setting pins it."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_threads import ThreadTuner


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_steps(tuner: ThreadTuner, steps: int, seconds_per_token: dict[int, float]) -> list[int]:
    used = []
    for _ in range(steps):
        tuner.before_step()
        used.append(torch.get_num_threads())
        tuner.after_step(seconds_per_token[torch.get_num_threads()] * 8, num_tokens=8)
    return used


def test_trial_alternates_candidates_then_keeps_the_fastest():
    tuner = ThreadTuner([1, 2], trial_steps=3, period=5)
    used = run_steps(tuner, 6, {1: 0.01, 2: 0.05})
    assert used == [1, 2, 1, 2, 1, 2]
    assert tuner.chosen == 1
    assert run_steps(tuner, 5, {1: 0.01, 2: 0.05}) == [1] * 5


def test_a_later_trial_switches_when_the_load_changes():
    tuner = ThreadTuner([1, 2], trial_steps=2, period=3)
    run_steps(tuner, 4, {1: 0.01, 2: 0.05})
    assert tuner.chosen == 1
    run_steps(tuner, 3 + 4, {1: 0.05, 2: 0.01})
    assert tuner.chosen == 2


def test_env_pins_the_thread_count(monkeypatch):
    monkeypatch.setenv("TIERGATE_CPU_THREADS", "1")
    assert ThreadTuner.from_env() is None
    assert torch.get_num_threads() == 1
