"""Fixtures for scheduler tests: a small pool, a sequence factory and the fake engine step."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan
from scheduler_driver import engine_step


@pytest.fixture
def step() -> Callable[[Scheduler], StepPlan]:
    return engine_step


@pytest.fixture
def small_config() -> SchedulerConfig:
    """10 blocks of 4 tokens; standard may hold 7 of them."""
    return SchedulerConfig(
        num_blocks=10,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=28,
        max_loras=2,
        standard_min_share=0.0,
    )


@pytest.fixture
def seq() -> Callable[..., Sequence]:
    """Make a sequence: seq(prompt_len or tokens, tier=..., adapter=..., max_tokens=...).

    Sequences arrive in the order they are made; generated prompts are unique.
    """
    counter = itertools.count()

    def make(prompt: int | list[int], tier: str = "standard", **kw) -> Sequence:
        n = next(counter)
        tokens = prompt if isinstance(prompt, list) else [(n * 7919 + i) % 997 + 1000 for i in range(prompt)]
        return Sequence(kw.pop("seq_id", f"s{n}"), list(tokens), tier=tier, **kw)

    return make
