"""What every throughput runner records: per-request timestamps and the run's totals."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bench.common.stats import percentile


@dataclass
class RequestTiming:
    index: int
    prompt_len: int
    output_tokens: int
    issued_s: float  # when the request was handed to the engine (a slot was free)
    first_token_s: float
    finished_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.issued_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass
class RunResult:
    engine: str
    concurrency: int
    wall_s: float
    timings: list[RequestTiming]
    extra: dict = field(default_factory=dict)  # peak RSS, KV pool use, notes

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict:
        ttft = [t.ttft_s for t in self.timings]
        tpot = [t.tpot_s for t in self.timings if t.tpot_s is not None]
        return {
            "engine": self.engine,
            "concurrency": self.concurrency,
            "requests": len(self.timings),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p99_s": percentile(tpot, 99),
            **self.extra,
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "requests": [asdict(t) for t in self.timings]}
