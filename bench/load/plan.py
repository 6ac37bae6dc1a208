"""What the load generator sends: one planned request per row, fixed by a seed or a trace."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.load.popularity import ZipfSampler
from bench.load.trace import TraceRecord


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str
    key: str


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    send_at: float | None  # seconds from the start; None in closed loop (sent when a worker is free)
    tenant: Tenant
    model: str  # the base model or an adapter name
    prompt_tokens: int
    output_tokens: int


def synthetic_plan(
    num_requests: int,
    tenants: list[Tenant],
    tier_share: dict[str, float],
    base_model: str,
    adapters: list[str] = (),
    adapter_fraction: float = 0.0,
    zipf_exponent: float = 1.0,
    prompt_len_range: tuple[int, int] = (20, 400),
    output_len_range: tuple[int, int] = (16, 256),
    send_times: list[float] | None = None,
    seed: int = 0,
) -> list[PlannedRequest]:
    """Requests whose tier, tenant, adapter and lengths are drawn with ``seed``."""
    tiers = [tier for tier, share in tier_share.items() if share > 0]
    by_tier = {tier: [t for t in tenants if t.tier == tier] for tier in tiers}
    missing = [tier for tier, members in by_tier.items() if not members]
    if missing:
        raise ValueError(f"no tenant key given for tier(s) {', '.join(missing)}")
    if send_times is not None and len(send_times) != num_requests:
        raise ValueError("need one send time per request")
    if adapter_fraction > 0 and not adapters:
        raise ValueError("adapter_fraction > 0 needs at least one adapter")
    rng = random.Random(seed)
    popularity = ZipfSampler(list(adapters), zipf_exponent, seed) if adapters else None
    plan = []
    for i in range(num_requests):
        tier = rng.choices(tiers, weights=[tier_share[t] for t in tiers])[0]
        tenant = rng.choice(by_tier[tier])
        model = popularity.sample() if popularity and rng.random() < adapter_fraction else base_model
        plan.append(PlannedRequest(
            index=i,
            send_at=None if send_times is None else send_times[i],
            tenant=tenant,
            model=model,
            prompt_tokens=rng.randint(*prompt_len_range),
            output_tokens=rng.randint(*output_len_range),
        ))
    return plan


def trace_plan(records: list[TraceRecord], tenants: list[Tenant], base_model: str) -> list[PlannedRequest]:
    """The trace's requests at their recorded times, each with its tenant's key."""
    by_name = {t.name: t for t in tenants}
    unknown = sorted({r.tenant for r in records} - by_name.keys())
    if unknown:
        raise ValueError(f"no key given for trace tenant(s) {', '.join(unknown)}")
    return [
        PlannedRequest(i, r.timestamp, by_name[r.tenant], r.adapter or base_model, r.prompt_tokens, r.output_tokens)
        for i, r in enumerate(records)
    ]


class PromptTexts:
    """Prompt text of about a given number of tokens.

    With the model's tokenizer the text is a decoded window of that many
    tokens of real prose; without one, words stand in for tokens. Each
    index's window starts elsewhere, so prompts do not share a prefix: the
    corpus has as many starts as units, and past them each round of indexes
    opens with its own tag, "(1) ", "(2) ", ... (a prefix cache would
    otherwise serve index n + i from index i's blocks).
    """

    def __init__(self, corpus: str, encode: Callable[[str], list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._encode, self._decode = encode, decode
        units = encode(corpus) if encode and decode else corpus.split()
        self._units = units
        self._joiner = "" if encode and decode else " "

    def text(self, num_tokens: int, index: int) -> str:
        n = len(self._units)
        stride = 97 if n % 97 else 89  # prime to n, so one round of n indexes starts at every unit once
        start, round_ = (index * stride) % n, index // n
        tag = f"({round_}) " if round_ else ""
        tag_units = (len(self._encode(tag)) if self._decode else 1) if tag else 0
        window = [self._units[(start + k) % n] for k in range(max(1, num_tokens - tag_units))]
        return tag + (self._decode(window) if self._decode else self._joiner.join(window))
