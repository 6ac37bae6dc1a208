"""The requests the engine thread runs, and the one path by which each of them ends.

Engine thread only. A request ends here exactly once, whatever ends it (its last
token, an abort, an error, an adapter unloaded): its blocks are freed, its finish
event goes to the listeners, then its last delta to its caller. Everything outside
the engine that keeps per-request state lets go of it on that finish event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.choices import ChoiceGroup
from engine.events import Listener
from engine.request import Delta
from engine.request_state import RequestState
from scheduler import Scheduler

Sink = Callable[[Delta], None]
Outgoing = list[tuple[Sink, Delta]]  # a step's last deltas, sent once its bookkeeping is done


class InFlight:
    def __init__(self, scheduler: Scheduler, emit: Listener, publish: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self._emit = emit
        self._publish = publish  # the engine's snapshots, refreshed before a caller hears of an end
        self._states: dict[str, RequestState] = {}  # by sequence id
        self._groups: dict[str, ChoiceGroup] = {}  # n > 1 and list-prompt requests by request id
        # Called with a sequence's id when it leaves the scheduler, however it ends (e.g. the speculator's
        # draft KV of it goes back).
        self.on_leave: list[Callable[[str], None]] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._groups

    def get(self, seq_id: str) -> RequestState | None:
        return self._states.get(seq_id)

    def seq_ids(self, adapter: str | None = None) -> list[str]:
        """The running sequences, or those using ``adapter``."""
        return [seq_id for seq_id, state in self._states.items()
                if adapter is None or state.request.adapter == adapter]

    def request_id_of(self, seq_id: str) -> str:
        state = self._states.get(seq_id)
        return state.request_id if state is not None else seq_id

    def add(self, state: RequestState) -> None:
        """Hand a request (the first choice of each of its prompts) to the scheduler; ValueError, with
        nothing left queued, if the scheduler refuses one."""
        leads = state.group.leads() if state.group is not None else [state]
        try:
            for lead in leads:
                self.scheduler.add(lead.seq)
                self._states[lead.seq.seq_id] = lead
        except ValueError:
            for lead in leads:
                if self._states.pop(lead.seq.seq_id, None) is not None:
                    self.scheduler.abort(lead.seq.seq_id)
            raise
        if state.group is not None:
            self._groups[state.request_id] = state.group

    def release_siblings(self, lead: RequestState) -> None:
        """A lead's prompt is computed and cached: its siblings can share it now (none: nothing to do)."""
        for sibling in lead.group.take_siblings(lead.index) if lead.group is not None else ():
            self.scheduler.add(sibling.seq, sibling_of=lead.seq.seq_id)
            self._states[sibling.seq.seq_id] = sibling

    def abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        for state in group.states if group is not None else [self._states.get(request_id)]:
            if state is not None:  # the first choice to end ends the group
                self.end(state.seq.seq_id, "cancelled", "abort")

    def refuse(self, state: RequestState, error: str) -> None:
        """End a request that never reached the scheduler."""
        self._emit(state.group.finish_event("error") if state.group else state.finish_event("error", "error"))
        usage = state.group.usage() if state.group else state.usage()
        state.sink(Delta(text="", finish_reason="error", usage=usage, error=error))

    def end(self, seq_id: str, status: str, finish_reason: str, last_delta: Delta | None = None,
            error: str | None = None, outgoing: Outgoing | None = None) -> None:
        """Finish a request: free its blocks, emit its finish event, then its last delta.

        With `outgoing` (a step's), the delta is appended there and the caller publishes and
        sends; otherwise both happen here.
        """
        state = self._states.pop(seq_id, None)
        if state is None:
            return
        if status == "ok":
            self.scheduler.finish(seq_id)
        else:
            self.scheduler.abort(seq_id)
        self._left(seq_id)
        last = last_delta or Delta(text="", finish_reason=finish_reason, usage=state.usage(), error=error,
                                   index=state.index)
        # The finish event goes out before the last delta, so the ledger row
        # can be complete by the time the caller sees the end of its stream.
        if state.group is None:
            self._emit(state.finish_event(status, finish_reason))
        else:
            last = self._end_choice(state, status, last)
        if outgoing is not None:
            outgoing.append((state.sink, last))
            return
        self._publish()
        state.sink(last)

    def end_all(self, status: str, finish_reason: str, error: str | None = None) -> None:
        for seq_id in list(self._states):
            self.end(seq_id, status, finish_reason, error=error)

    def _left(self, seq_id: str) -> None:
        for callback in self.on_leave:
            callback(seq_id)

    def _end_choice(self, state: RequestState, status: str, last: Delta) -> Delta:
        """One choice of an n > 1 or list-prompt request ended; the request's usage and finish event come with its last."""
        group = state.group
        for seq_id in group.end_choice(state.index, status, last.finish_reason):
            if self._states.pop(seq_id, None) is not None:
                self.scheduler.abort(seq_id)
                self._left(seq_id)
        if group.unfinished:
            return dataclasses.replace(last, usage=None)
        self._groups.pop(group.request_id, None)
        self._emit(group.finish_event(status))
        return dataclasses.replace(last, usage=group.usage())
