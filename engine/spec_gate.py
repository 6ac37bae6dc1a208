"""Whether a step of so many decoding rows should draft at all: measured on this machine, not assumed.

Verifying drafts pays while a step is bound by reading the weights; past some batch size (which
depends on the model, the kernels, the device and what else the machine runs) the drafted
positions cost more than the tokens they add. So for each batch size class (decoding rows rounded
up to a power of two) the gate keeps a running rate of tokens per second over the pure decode
steps that drafted and over those that did not, lets the better mode run, and gives the other one
step in ``explore_every`` so that its rate follows changes in load and content. A mode that loses
thus costs at most that one step in ``explore_every``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rate:
    """Tokens over seconds, both decayed per observation."""

    tokens: float = 0.0
    seconds: float = 0.0
    observed: int = 0

    def add(self, tokens: int, seconds: float, memory: float) -> None:
        self.tokens = memory * self.tokens + tokens
        self.seconds = memory * self.seconds + seconds
        self.observed += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    plain: _Rate = field(default_factory=_Rate)
    drafted: _Rate = field(default_factory=_Rate)
    steps: int = 0


class BatchGate:
    def __init__(self, explore_every: int = 20, memory: float = 0.9, warmup: int = 3) -> None:
        self.explore_every = explore_every
        self.memory = memory
        self.warmup = warmup  # observations of each mode before the rates are compared
        self._buckets: dict[int, _Bucket] = {}

    def drafts(self, rows: int) -> bool:
        """Whether a step with ``rows`` decoding rows should draft."""
        bucket = self._bucket(rows)
        bucket.steps += 1
        if min(bucket.plain.observed, bucket.drafted.observed) < self.warmup:
            return bucket.drafted.observed <= bucket.plain.observed
        better = bucket.drafted.per_s >= bucket.plain.per_s
        return better != (bucket.steps % self.explore_every == 0)

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A pure decode step of ``rows`` rows gave ``tokens`` tokens in ``seconds``, with or without drafts."""
        bucket = self._bucket(rows)
        (bucket.drafted if drafted else bucket.plain).add(tokens, seconds, self.memory)

    def _bucket(self, rows: int) -> _Bucket:
        return self._buckets.setdefault(1 << max(rows - 1, 0).bit_length(), _Bucket())
