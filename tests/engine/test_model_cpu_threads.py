"""The CPU thread count follows measured step times, an env setting pins it, and only the engine thread
runs torch on several threads (engine/cpu_threads.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu_threads import ThreadTuner
from engine.engine import Engine
from engine.events import StepEvent
from engine.request import EngineRequest, SamplingParams


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_steps(tuner: ThreadTuner, steps: int, seconds_per_token: dict[int, float], num_tokens: int = 8,
              bound_slack: float | None = None) -> list[int]:
    used = []
    for _ in range(steps):
        tuner.before_step(num_tokens, bound_slack)
        used.append(torch.get_num_threads())
        tuner.after_step(seconds_per_token[torch.get_num_threads()] * num_tokens)
    return used


def test_trial_alternates_candidates_then_keeps_the_fastest():
    tuner = ThreadTuner([1, 2], trial_steps=3, period=5)
    used = run_steps(tuner, 6, {1: 0.01, 2: 0.05})
    assert used == [1, 2, 1, 2, 1, 2]
    assert tuner.chosen(8) == 1
    assert run_steps(tuner, 5, {1: 0.01, 2: 0.05}) == [1] * 5


def test_a_step_that_cannot_afford_running_slower_within_its_bound_waits_out_the_trial():
    tuner = ThreadTuner([1, 2], trial_steps=2, period=5)
    # Each step planned to half its latency bound: on one thread of two it could run twice as long.
    assert run_steps(tuner, 3, {1: 0.01, 2: 0.05}, bound_slack=1.9) == [2, 2, 2]
    assert run_steps(tuner, 4, {1: 0.01, 2: 0.05}, bound_slack=2.0) == [1, 2, 1, 2]  # the trial, not skewed
    assert tuner.chosen(8) == 1


def test_a_later_trial_switches_when_the_load_changes():
    tuner = ThreadTuner([1, 2], trial_steps=2, period=3)
    run_steps(tuner, 4, {1: 0.01, 2: 0.05})
    assert tuner.chosen(8) == 1
    run_steps(tuner, 3 + 4, {1: 0.05, 2: 0.01})
    assert tuner.chosen(8) == 2


def test_each_step_size_keeps_its_own_choice():
    # A cheap-per-token prefill on one count must not outvote decodes on the other.
    tuner = ThreadTuner([1, 2], trial_steps=3, period=100)
    for _ in range(6):
        run_steps(tuner, 1, {1: 0.001, 2: 0.002}, num_tokens=300)  # prefills: 1 thread wins
        run_steps(tuner, 1, {1: 0.047, 2: 0.028}, num_tokens=1)  # decodes: 2 threads win
    assert (tuner.chosen(300), tuner.chosen(257), tuner.chosen(1)) == (1, 1, 2)
    assert tuner.choices() == {1: 2, 512: 1}
    assert run_steps(tuner, 3, {1: 0.047, 2: 0.028}, num_tokens=1) == [2, 2, 2]


def test_env_pins_the_count_on_the_thread_that_runs_the_steps(monkeypatch):
    monkeypatch.setenv("TIERGATE_CPU_THREADS", "3")
    torch.set_num_threads(1)
    tuner = ThreadTuner.from_env()
    assert torch.get_num_threads() == 1  # not on the thread that built the tuner
    assert run_steps(tuner, 4, {3: 0.01}) == [3] * 4


def test_only_the_engine_thread_runs_torch_on_several_threads(monkeypatch, tiny_model_dirs: dict[str, Path],
                                                              engine_cache_dir: Path):
    monkeypatch.setenv("TIERGATE_CPU_THREADS", "2")
    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model=str(tiny_model_dirs["gqa_untied"]), block_size=4, num_kv_blocks=32,
                                 max_loras=0, cache_dir=str(engine_cache_dir)))
    counts_in_steps: list[tuple[str, int]] = []
    engine.add_listener(lambda event: counts_in_steps.append((threading.current_thread().name,
                                                              torch.get_num_threads()))
                        if isinstance(event, StepEvent) else None)
    with engine:
        engine.generate_batch_sync([EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))])
        loader_count = engine._adapter_loader.submit(torch.get_num_threads).result()
    assert counts_in_steps and set(counts_in_steps) == {("engine-loop", 2)}
    assert torch.get_num_threads() == 1  # the thread that built the engine and loaded the model
    assert loader_count == 1


@pytest.mark.parametrize("given, expected", [(None, "10000"), ("500", "500")])
def test_openmp_spin_is_short_unless_the_operator_set_it(given, expected):
    # In a fresh process: libgomp reads the variable when torch is first imported.
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | ({"GOMP_SPINCOUNT": given} if given else {})
    probe = "import engine, sys, os; assert 'torch' not in sys.modules; print(os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == expected
