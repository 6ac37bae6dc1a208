"""Sending one planned request to the gateway and timing its SSE stream."""

from __future__ import annotations

import json
import time

import httpx

from bench.load.aggregate import RequestResult
from bench.load.plan import PlannedRequest


def request_body(req: PlannedRequest, prompt: str, endpoint: str, ignore_eos: bool) -> dict:
    body: dict = {
        "model": req.model,
        "max_tokens": req.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: exact output lengths
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _error_code(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error.get("code") or error.get("type") or status)
    except (ValueError, KeyError, TypeError):
        return str(status)


def _chunk_has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send(client: httpx.AsyncClient, base_url: str, req: PlannedRequest, prompt: str,
               endpoint: str, ignore_eos: bool, run_start: float) -> RequestResult:
    """Stream one request; TTFT is the first chunk carrying text, tokens come from usage."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    result = RequestResult(req.index, req.tenant.tier, req.tenant.name, req.model, req.prompt_tokens,
                           started_s=time.perf_counter() - run_start, status=0)
    start = time.perf_counter()
    text_chunks = 0
    last_text_at = None
    usage_tokens = None
    try:
        async with client.stream("POST", base_url + path, json=request_body(req, prompt, endpoint, ignore_eos),
                                 headers={"Authorization": f"Bearer {req.tenant.key}"}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error_code = _error_code(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream started
                    result.error_code = _error_code(200, data.encode())
                    break
                if _chunk_has_output(chunk):
                    text_chunks += 1
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.gaps_s.append(now - last_text_at)
                    last_text_at = now
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
    except httpx.HTTPError as exc:
        result.error_code = type(exc).__name__
        return result
    result.e2e_s = time.perf_counter() - start
    # Chunks can hold several tokens (held-back text), so usage is the count when given.
    result.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
    return result


async def scrape_counter(client: httpx.AsyncClient, base_url: str, name: str) -> dict[str, float]:
    """A counter's value per tier label from /metrics ({} if the gateway has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get(base_url + "/metrics")
    if response.status_code != 200:
        return {}
    family = name.removesuffix("_total")
    values: dict[str, float] = {}
    for metric in text_string_to_metric_families(response.text):
        if metric.name != family:
            continue
        for sample in metric.samples:
            if sample.name == name:
                tier = sample.labels.get("tier", "")
                values[tier] = values.get(tier, 0.0) + sample.value
    return values
