"""Sending a batch of completion lines to a gateway for the batch tier bench, and sampling tokens per tier.

Two ways, picked by what the server answers: OpenAI's Files and Batches API (``POST /v1/files`` with
``purpose=batch``, ``POST /v1/batches``, polled until it ends) when the server has it; else each line
as a ``/v1/completions`` request of a tenant whose tier is ``batch``, a bounded window of them in
flight, as a batch driver inside the server would feed the engine. A 404 (or 405) on
``POST /v1/files`` means the server has no Files API.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# OpenAI's batch statuses after which nothing more runs.
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class BatchOutcome:
    """What one batch run did, as the client saw it."""

    via: str  # "files-api" or "completions"
    lines: int
    ok: int = 0
    failed: int = 0
    retried: int = 0  # 429/503 answers retried after Retry-After (completions path)
    started_at: float = 0.0  # time.perf_counter()
    finished_at: float = 0.0
    status: str = ""  # the batch's last status (files-api path)
    errors: dict[str, int] = field(default_factory=dict)


def line_body(model: str, prompt: str, max_tokens: int) -> dict:
    """One line's request: greedy, exactly ``max_tokens`` tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def has_files_api(client: httpx.AsyncClient, base_url: str, key: str) -> bool:
    """Whether ``POST /v1/files`` exists: an empty upload is refused (400) by a server that has it."""
    response = await client.post(base_url + "/v1/files", headers={"authorization": f"Bearer {key}"},
                                 data={"purpose": "batch"})
    return response.status_code not in (404, 405)


async def run_via_completions(client: httpx.AsyncClient, base_url: str, key: str, bodies: list[dict],
                              window: int) -> BatchOutcome:
    """Every line as a non-streamed completion, ``window`` in flight; 429 and 503 are retried."""
    outcome = BatchOutcome("completions", len(bodies), started_at=time.perf_counter())
    lines = iter(bodies)
    headers = {"authorization": f"Bearer {key}"}

    async def worker() -> None:
        for body in lines:  # a shared iterator: each line goes to exactly one worker
            while True:
                try:
                    response = await client.post(base_url + "/v1/completions", json=body, headers=headers)
                except httpx.HTTPError as exc:
                    _count(outcome, type(exc).__name__)
                    break
                if response.status_code in (429, 503):
                    outcome.retried += 1
                    await asyncio.sleep(min(5.0, float(response.headers.get("retry-after", "1"))))
                    continue
                if response.status_code == 200:
                    outcome.ok += 1
                else:
                    _count(outcome, str(response.status_code))
                break

    await asyncio.gather(*(worker() for _ in range(window)))
    outcome.finished_at = time.perf_counter()
    return outcome


async def run_via_files_api(client: httpx.AsyncClient, base_url: str, key: str, bodies: list[dict],
                            poll_s: float = 1.0) -> BatchOutcome:
    """Upload the lines as JSONL, create a batch on /v1/completions, poll it until it ends, count its output."""
    outcome = BatchOutcome("files-api", len(bodies), started_at=time.perf_counter())
    headers = {"authorization": f"Bearer {key}"}
    jsonl = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": b})
                    + "\n" for i, b in enumerate(bodies))
    upload = await client.post(base_url + "/v1/files", headers=headers, data={"purpose": "batch"},
                               files={"file": ("batch.jsonl", jsonl.encode(), "application/jsonl")})
    upload.raise_for_status()
    created = await client.post(base_url + "/v1/batches", headers=headers, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    created.raise_for_status()
    batch = created.json()
    while batch["status"] not in TERMINAL:
        await asyncio.sleep(poll_s)
        polled = await client.get(f"{base_url}/v1/batches/{batch['id']}", headers=headers)
        polled.raise_for_status()
        batch = polled.json()
    outcome.finished_at = time.perf_counter()
    outcome.status = batch["status"]
    if batch.get("output_file_id"):
        content = await client.get(f"{base_url}/v1/files/{batch['output_file_id']}/content", headers=headers)
        content.raise_for_status()
        for row in content.text.splitlines():
            status = (json.loads(row).get("response") or {}).get("status_code")
            if status == 200:
                outcome.ok += 1
            else:
                _count(outcome, str(status))
    outcome.failed = outcome.lines - outcome.ok
    return outcome


def _count(outcome: BatchOutcome, error: str) -> None:
    outcome.failed += 1
    outcome.errors[error] = outcome.errors.get(error, 0) + 1


COUNTERS = {"completion": ("tiergate_tokens_total", "completion"), "cached": ("tiergate_tokens_total", "cached"),
            "engine_s": ("tiergate_gpu_seconds_total", None)}


def tier_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per ``COUNTERS`` name, per tier, from a /metrics page: completion and cached prompt tokens
    (``tiergate_tokens_total``), and the engine seconds billed to the tier (``tiergate_gpu_seconds_total``)."""
    out: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            for name, (metric, kind) in COUNTERS.items():
                if sample.name == metric and sample.labels.get("kind") == kind:
                    out[name][sample.labels["tier"]] = sample.value
    return out


Samples = list[tuple[float, dict[str, float]]]


async def sample_tokens(client: httpx.AsyncClient, base_url: str, every_s: float, origin: float,
                        samples: Samples, stop: asyncio.Event, others: dict[str, Samples] | None = None) -> None:
    """Append (seconds since ``origin``, completion tokens per tier) every ``every_s`` until ``stop``; the other
    ``COUNTERS`` named in ``others``, read from the same page, into theirs."""
    async def take() -> None:
        response = await client.get(base_url + "/metrics")
        response.raise_for_status()
        counters = tier_counters(response.text)
        at = time.perf_counter() - origin
        samples.append((at, counters["completion"]))
        for name, into in (others or {}).items():
            into.append((at, counters[name]))

    while True:
        await take()
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            await take()
            return
        except asyncio.TimeoutError:
            pass
