"""Times engine steps: wall time on CPU, CUDA events on GPU (what metering bills)."""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: str) -> None:
        self.device = device
        self._cuda = device.startswith("cuda")
        self._t0 = 0.0
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            self._start_event.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start(); waits for the GPU to finish the step's work."""
        if self._cuda:
            self._end_event.record()
            self._end_event.synchronize()
            return self._start_event.elapsed_time(self._end_event) / 1000.0
        return time.perf_counter() - self._t0
