"""The structured-outputs bench's hook into the engine stands in for the step loop's mask call exactly."""

from __future__ import annotations

import inspect

import torch

from bench.offline.structured import MaskTimer
from engine.grammar import mask_logits


def test_the_mask_timer_takes_the_step_loops_arguments_and_returns_the_rows_over_budget():
    timer = MaskTimer()
    logits = torch.zeros(2, 8)
    assert timer(logits, [None, None], 0.05) == [] and timer(logits, [None, None]) == []
    assert timer.calls == 2 and timer.seconds >= 0
    assert list(inspect.signature(timer).parameters) == list(inspect.signature(mask_logits).parameters)
