"""Chooses the CPU intra-op thread count by timing real steps, and re-checks now and then.

The best count depends on whether the cores are shared, which no setting can know
ahead, and on the step's size (docs/performance.md; bench/RESULTS.md has the measurements). So each step
size (its token count rounded up to a power of two) keeps its own choice: its steps
alternate between the candidates for a few steps, the fastest per token wins, and the
trial is repeated every ``period`` steps of that size. A trial step on fewer threads is
slower by design, so it waits for a step that can afford it: one under no inter-token
latency bound, or one predicted to end within its bound even that much slower: a prefill
chunk sized to fill a stream's bound, run on one thread of two, makes that stream's gap up
to twice the bound. ``TIERGATE_CPU_THREADS`` pins a count instead.

Only the engine thread runs torch on more than one thread; every other thread
that touches torch (the one that loads the model, the adapter loader) calls
``run_torch_serially_here`` first. The reason is libgomp: each thread that
starts a parallel region keeps its own team of OpenMP workers for good, and once
the workers of all teams outnumber the cores, libgomp stops spinning between
regions and puts workers to sleep instead, which slows every step of the engine thread.
"""

from __future__ import annotations

import statistics

import torch

from tiergate_common.env import CPU_THREADS

# torch's own default (one per physical core), read before any tuner changes it.
DEFAULT_THREADS = torch.get_num_threads()


def run_torch_serially_here() -> None:
    """Make torch single-threaded on the calling thread (see the module docstring for why).

    torch gives a thread its count from the process-wide one when the thread first
    uses it; that happens here first, so a later change by the engine thread's tuner
    cannot seed this thread with more.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)


def size_class(num_tokens: int) -> int:
    """The step sizes that share a choice: token counts rounded up to a power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


class _SizeChoice:
    """The count chosen for one step size, and the trial that chooses it."""

    def __init__(self, candidates: list[int], trial_steps: int, period: int) -> None:
        self.candidates = candidates
        self.trial_steps = trial_steps
        self.period = period
        self.chosen = candidates[-1]
        self.samples: dict[int, list[float]] = {}
        self.schedule: list[int] = []
        self.steps_to_trial = 0

    def next_count(self) -> int:
        if not self.schedule and self.steps_to_trial <= 0 and len(self.candidates) > 1:
            # Alternate so both counts see the same load.
            self.schedule = [c for _ in range(self.trial_steps) for c in self.candidates]
            self.samples = {c: [] for c in self.candidates}
        return self.schedule.pop(0) if self.schedule else self.chosen

    def record(self, count: int, seconds_per_token: float) -> None:
        if count in self.samples and len(self.samples[count]) < self.trial_steps:
            self.samples[count].append(seconds_per_token)
            if not self.schedule:
                self.chosen = min(self.candidates, key=lambda c: statistics.median(self.samples[c]))
                self.samples = {}
                self.steps_to_trial = self.period
            return
        self.steps_to_trial -= 1


class ThreadTuner:
    """Sets the calling thread's torch thread count before each step; lives on the thread that runs the steps."""

    def __init__(self, candidates: list[int], trial_steps: int = 3, period: int = 1000) -> None:
        self.candidates = sorted(set(candidates))
        self.trial_steps = trial_steps
        self.period = period
        self._by_size: dict[int, _SizeChoice] = {}
        self._step: tuple[_SizeChoice, int, int] | None = None  # (its size's choice, count, tokens)

    @classmethod
    def from_env(cls) -> ThreadTuner:
        """Candidates 1 and torch's default, or only the count ``TIERGATE_CPU_THREADS`` pins.

        Counts apply to the thread that runs the steps, so a pinned one is set there too, by ``before_step``.
        """
        pinned = CPU_THREADS.get()
        return cls([pinned] if pinned is not None else [1, DEFAULT_THREADS])

    def chosen(self, num_tokens: int) -> int:
        """The count steps of this many tokens run on outside a trial."""
        choice = self._by_size.get(size_class(num_tokens))
        return choice.chosen if choice is not None else self.candidates[-1]

    def choices(self) -> dict[int, int]:
        """The count chosen so far for each step size seen (sizes as ``size_class`` rounds them)."""
        return {size: choice.chosen for size, choice in sorted(self._by_size.items())}

    def before_step(self, num_tokens: int, bound_slack: float | None = None) -> None:
        """Set the count for a step of ``num_tokens``; ``bound_slack``: how many times its predicted time the step
        may take within its latency bound (``StepPlan.bound_slack``; None: no bound)."""
        size = size_class(num_tokens)
        choice = self._by_size.get(size)
        if choice is None:
            choice = self._by_size[size] = _SizeChoice(self.candidates, self.trial_steps, self.period)
        may_trial = bound_slack is None or bound_slack >= self.candidates[-1] / self.candidates[0]
        count = choice.next_count() if may_trial else choice.chosen
        self._step = (choice, count, num_tokens) if may_trial else None  # a step kept out of trials is not timed
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)

    def after_step(self, seconds: float) -> None:
        if self._step is None:
            return
        choice, count, num_tokens = self._step
        choice.record(count, seconds / max(num_tokens, 1))
