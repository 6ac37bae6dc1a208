"""Pure scheduling policy: sequences, KV block accounting, FCFS and tiered policies.

Imports nothing of the project and no torch, so it can be tested and simulated
in microseconds.
"""

from scheduler.config import SchedulerConfig, TierConfig
from scheduler.load import TierLoad
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "SchedulerConfig",
    "TierConfig",
    "TierLoad",
    "ScheduledChunk",
    "StepPlan",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
]
