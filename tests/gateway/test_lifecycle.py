"""A drain waits for in-flight requests up to its timeout, then interrupts the rest and waits for their ends."""

from __future__ import annotations

import asyncio

from gateway.lifecycle import Lifecycle


class SlowRequest:
    """Finishes by itself after ``runs_s``, or soon after an interruption."""

    def __init__(self, lifecycle: Lifecycle, runs_s: float) -> None:
        self.lifecycle, self.interrupted = lifecycle, False
        lifecycle.enter(self)
        self._task = asyncio.get_running_loop().call_later(runs_s, self._end)

    def interrupt(self) -> None:
        self.interrupted = True
        self._task.cancel()
        asyncio.get_running_loop().call_later(0.01, self._end)

    def _end(self) -> None:
        self.lifecycle.exit(self)


def test_requests_that_finish_in_time_are_not_interrupted():
    async def go():
        drained = []
        lifecycle = Lifecycle(on_drain=lambda: drained.append(True))
        request = SlowRequest(lifecycle, 0.05)
        finished = await lifecycle.drain(timeout_s=5)
        return finished, request.interrupted, drained, lifecycle

    finished, interrupted, drained, lifecycle = asyncio.run(go())
    assert finished and not interrupted and drained == [True]
    assert lifecycle.draining and lifecycle.in_flight == 0


def test_requests_still_running_at_the_deadline_are_interrupted_and_waited_for():
    async def go():
        lifecycle = Lifecycle()
        quick, slow = SlowRequest(lifecycle, 0.01), SlowRequest(lifecycle, 60)
        finished = await lifecycle.drain(timeout_s=0.2, grace_s=5)
        return finished, quick.interrupted, slow.interrupted, lifecycle.in_flight

    assert asyncio.run(go()) == (False, False, True, 0)


def test_an_idle_server_drains_at_once_even_with_no_time_given():
    async def go():
        lifecycle = Lifecycle()
        return await lifecycle.drain(timeout_s=0)

    assert asyncio.run(go())
