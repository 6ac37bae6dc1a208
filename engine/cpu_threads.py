"""Chooses the CPU intra-op thread count by timing real steps, and re-checks now and then.

The best count depends on whether the cores are shared, which no setting can
know ahead. Measured on the 2-core box with other processes running: 2
OpenMP threads made a decode step of the bundled model 6-15x slower than 1
thread (a spinning worker waits on a descheduled peer every op), while a
dedicated box should favour one thread per core. So steps alternate between
the candidates for a few steps, the fastest per token wins, and the trial is
repeated every ``period`` steps. ``TIERGATE_CPU_THREADS`` pins a count instead.
"""

from __future__ import annotations

import os
import statistics

import torch

# torch's own default (one per physical core), read before any tuner changes it.
DEFAULT_THREADS = torch.get_num_threads()


class ThreadTuner:
    def __init__(self, candidates: list[int], trial_steps: int = 3, period: int = 1000) -> None:
        self.candidates = sorted(set(candidates))
        self.trial_steps = trial_steps
        self.period = period
        self.chosen = self.candidates[-1]
        self._samples: dict[int, list[float]] = {}
        self._schedule: list[int] = []
        self._current = self.chosen
        self._steps_to_trial = 0

    @classmethod
    def from_env(cls) -> ThreadTuner | None:
        """None when ``TIERGATE_CPU_THREADS`` pins the count (applied here) or only one is possible."""
        pinned = os.environ.get("TIERGATE_CPU_THREADS")
        if pinned:
            torch.set_num_threads(int(pinned))
            return None
        return cls([1, DEFAULT_THREADS]) if DEFAULT_THREADS > 1 else None

    def before_step(self) -> None:
        if not self._schedule and self._steps_to_trial <= 0:
            # Alternate so both counts see the same load and the same batch shapes.
            self._schedule = [c for _ in range(self.trial_steps) for c in self.candidates]
            self._samples = {c: [] for c in self.candidates}
        self._current = self._schedule.pop(0) if self._schedule else self.chosen
        if torch.get_num_threads() != self._current:
            torch.set_num_threads(self._current)

    def after_step(self, seconds: float, num_tokens: int) -> None:
        if self._current in self._samples and len(self._samples[self._current]) < self.trial_steps:
            self._samples[self._current].append(seconds / max(num_tokens, 1))
            if not self._schedule:
                self.chosen = min(self.candidates, key=lambda c: statistics.median(self._samples[c]))
                self._samples = {}
                self._steps_to_trial = self.period
            return
        self._steps_to_trial -= 1
