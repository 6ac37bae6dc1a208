"""Per-tier latency percentiles, goodput and error counts of a finished run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.common.stats import summarize


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_s is not None and (result.ttft_s is None or result.ttft_s > self.ttft_s):
            return False
        tpot = result.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass
class RequestResult:
    index: int
    tier: str
    tenant: str
    model: str
    prompt_tokens: int
    started_s: float  # when it was sent, from the run's start
    status: int  # HTTP status; 0 when the connection failed
    error_code: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between two chunks carrying text, as the client saw them

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def tier_report(results: list[RequestResult], duration_s: float, slos: dict[str, Slo]) -> dict[str, dict]:
    """Per tier: counts, latency percentiles, goodput and throughput over ``duration_s``."""
    report = {}
    for tier in sorted({r.tier for r in results}):
        rows = [r for r in results if r.tier == tier]
        ok = [r for r in rows if r.ok]
        good = [r for r in ok if slos.get(tier, Slo()).met_by(r)]
        report[tier] = {
            "requests": len(rows),
            "ok": len(ok),
            "rejected_429": dict(Counter(r.error_code or "unknown" for r in rows if r.status == 429)),
            "errors": dict(Counter(f"{r.status}:{r.error_code}" for r in rows if not r.ok and r.status != 429)),
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
            "inter_token_s": summarize([g for r in ok for g in r.gaps_s]),
            "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
            "goodput_requests": len(good),
            "goodput_fraction": len(good) / len(rows) if rows else None,
            "goodput_rps": len(good) / duration_s if duration_s > 0 else None,
            "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
            "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else None,
        }
    return report
