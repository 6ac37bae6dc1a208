"""Parallel sampling (n > 1) and list prompts: one request's sequences, n sibling choices per prompt.

Choices are numbered prompt-major, as OpenAI orders a list prompt's choices:
choice ``p * n + j`` is the j-th of prompt p. The first choice of each prompt
(its lead) goes to the scheduler alone, as a sequence of its own; its siblings
follow once its prompt is computed, so their full prompt blocks come from the
prefix cache (reference-counted, shared) and only the last, partial block is each sibling's
own: copy-on-write done by recomputing those few tokens rather than copying the
block, so the scheduler's one-owner-or-refcounted invariant holds unchanged.
They join their admitted lead (``Scheduler.add(..., sibling_of=...)``): first
in their queue, in its place in arrival order, admitted before anything queued.
The group is one request to everything outside the engine: one id, one finish
event with the sum of its tokens (each prompt's counted once), and its step items under that id.
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
    n: int = 1  # choices per prompt
    waiting: dict[int, list] = field(default_factory=dict)  # by lead index: siblings not yet given to the scheduler
    unfinished: int = 0
    reasons: dict[int, str] = field(default_factory=dict)  # finish_reason by index

    def __post_init__(self) -> None:
        self.unfinished = len(self.states)

    @classmethod
    def link(cls, states: list, n: int) -> ChoiceGroup:
        """Group the states of one request's choices (``n`` per prompt); siblings wait for their lead's prompt."""
        waiting = {lead: states[lead + 1:lead + n] for lead in range(0, len(states), n)} if n > 1 else {}
        group = cls(states[0].request_id, states, n, waiting=waiting)
        for state in states:
            state.group = group
        return group

    def leads(self) -> list:
        """The first choice of each prompt: the states that go to the scheduler first."""
        return self.states[::self.n]

    def take_siblings(self, index: int) -> list:
        """The waiting siblings of lead ``index`` (none for any other choice), no longer waiting."""
        return self.waiting.pop(index, [])

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
        prompts = [s.usage() for s in self.leads()]
        completion = sum(len(s.seq.output_token_ids) for s in self.states)
        return Usage(prompt_tokens=sum(u.prompt_tokens for u in prompts), completion_tokens=completion,
                     cached_tokens=sum(u.cached_tokens for u in prompts))

    def finish_event(self, status: str) -> FinishEvent:
        """The first choice's event, with the whole request's tokens and times."""
        usage = self.usage()
        starts = [s.first_token_at for s in self.states if s.first_token_at is not None]
        return dataclasses.replace(
            self.states[0].finish_event(status, self.reasons.get(0, "abort")),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            first_token_at=min(starts, default=None),
            queue_s=max(s.seq.queue_time_s for s in self.states),
        )
