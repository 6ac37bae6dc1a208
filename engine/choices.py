"""Parallel sampling (n > 1): one request's choices as sibling sequences that share its prompt.

The first choice goes to the scheduler alone; its siblings follow once its
prompt is computed, so their full prompt blocks come from the prefix cache
(reference-counted, shared) and only the last, partial block is each sibling's
own: copy-on-write done by recomputing those few tokens rather than copying the
block, so the scheduler's one-owner-or-refcounted invariant holds unchanged.
They join their admitted request (``Scheduler.add(..., sibling_of=...)``): first
in their queue, in its place in arrival order, admitted before anything queued.
The group is one request to everything outside the engine: one id, one finish
event with the sum of its tokens, and its step items under that id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.events import FinishEvent
from engine.request import Usage


def choice_seq_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class ChoiceGroup:
    request_id: str
    states: list  # RequestState of each choice, by index
    waiting: list = field(default_factory=list)  # siblings not yet given to the scheduler
    unfinished: int = 0
    reasons: dict[int, str] = field(default_factory=dict)  # finish_reason by index

    def __post_init__(self) -> None:
        self.unfinished = len(self.states)

    @classmethod
    def link(cls, states: list) -> ChoiceGroup:
        """Group the states of one request's choices; all but the first wait for its prompt."""
        group = cls(states[0].request_id, states, waiting=states[1:])
        for state in states:
            state.group = group
        return group

    def end_choice(self, index: int, status: str, finish_reason: str) -> list[str]:
        """Account a choice's end; the sequence ids of siblings to abort with it (a failed or
        cancelled choice ends the whole request)."""
        self.reasons[index] = finish_reason
        self.unfinished -= 1
        if status == "ok":
            return []
        self.waiting.clear()
        self.unfinished = 0
        return [s.seq.seq_id for s in self.states if s.index != index]

    def usage(self) -> Usage:
        first = self.states[0].usage()
        completion = sum(len(s.seq.output_token_ids) for s in self.states)
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                     cached_tokens=first.cached_tokens)

    def finish_event(self, status: str) -> FinishEvent:
        """The first choice's event, with the whole request's tokens and times."""
        usage = self.usage()
        starts = [s.first_token_at for s in self.states if s.first_token_at is not None]
        return dataclasses.replace(
            self.states[0].finish_event(status, self.reasons.get(0, "abort")),
            completion_tokens=usage.completion_tokens,
            first_token_at=min(starts, default=None),
            queue_s=max(s.seq.queue_time_s for s in self.states),
        )
