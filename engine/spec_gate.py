"""How many tokens a step of so many decoding rows should draft per row: measured on this machine, not assumed.

Verifying drafts pays while a step is bound by reading the weights; as the batch grows each drafted
position costs more of the step (how much depends on the model, the kernels, the device and what
else the machine runs), so fewer drafts per row pay at a middling batch and none at a large one.
So for each batch size class (decoding rows rounded up to a power of two) the gate keeps a running
rate of tokens per second over the pure decode steps run with each draft length it may choose (0:
no drafts), lets the best one run, and gives each other one step in turn every ``explore_every``
so that its rate follows changes in load and content. A length that loses thus costs at most one
step in ``explore_every``.
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
    rates: dict[int, _Rate] = field(default_factory=dict)  # by draft length
    steps: int = 0


def draft_lengths(num_tokens: int) -> tuple[int, ...]:
    """The lengths a gate chooses among for drafts of at most ``num_tokens``: none, the powers of two
    below it, and itself (4: 0, 1, 2, 4)."""
    powers = {1 << i for i in range(num_tokens.bit_length()) if 1 << i < num_tokens}
    return tuple(sorted({0, num_tokens} | powers))


class BatchGate:
    def __init__(self, lengths: tuple[int, ...] = (0, 1), explore_every: int = 20, memory: float = 0.9,
                 warmup: int = 3) -> None:
        if 0 not in lengths or len(lengths) < 2:
            raise ValueError("a batch gate chooses between no drafts and at least one draft length")
        self.lengths = tuple(sorted(lengths))
        self.explore_every = explore_every
        self.memory = memory
        self.warmup = warmup  # observations of each length before the rates are compared
        self._buckets: dict[int, _Bucket] = {}

    def draft_length(self, rows: int) -> int:
        """How many tokens each row of a step with ``rows`` decoding rows may draft (0: none)."""
        bucket = self._bucket(rows)
        bucket.steps += 1
        rates = bucket.rates
        unmeasured = [n for n in self.lengths if rates[n].observed < self.warmup]
        if unmeasured:  # the longest first: where drafts pay (a small batch), they pay most
            return min(unmeasured, key=lambda n: (rates[n].observed, -n))
        best = max(self.lengths, key=lambda n: (rates[n].per_s, n))
        if bucket.steps % self.explore_every:
            return best
        others = [n for n in self.lengths if n != best]
        return others[(bucket.steps // self.explore_every) % len(others)]

    def observe(self, rows: int, length: int, tokens: int, seconds: float) -> None:
        """A pure decode step of ``rows`` rows, run with drafts of ``length`` (0: none), gave ``tokens``
        tokens in ``seconds``."""
        self._bucket(rows).rates[length].add(tokens, seconds, self.memory)

    def _bucket(self, rows: int) -> _Bucket:
        key = 1 << max(rows - 1, 0).bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket({n: _Rate() for n in self.lengths})
        return bucket
