"""A batch's input lines checked one by one with the live endpoints' own checks, when the batch is validated.

Each line must be ``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}`` with a
custom_id no other line has; its body goes through exactly what a live request's goes through
(the endpoint's parse, the model or adapter grant, gateway/completions.py's ``prepare``: prompt
size, context length, the engine's own checks), so a line that would be a 400 live fails the
batch here, named in OpenAI's ``errors`` object. A line cannot stream: its answer goes to a file.
gateway/batch_intake.py feeds the lines in as the file's chunks are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from billing.batches import LineSpec
from gateway.completions import CHAT, COMPLETION, Endpoint, prepare, resolve_adapter
from gateway.errors import APIError
from gateway.services import Gateway

ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
BATCH_TIER = "batch"
# Errors shown in a failed batch's errors object: enough to fix a file, bounded in size.
MAX_ERRORS = 100
MAX_CUSTOM_ID = 512


@dataclass
class Checked:
    """What the lines checked so far came to: the errors to show (the first MAX_ERRORS), and counts."""

    errors: list[dict[str, Any]] = field(default_factory=list)
    failed_lines: int = 0
    passed_lines: int = 0
    tokens: int = 0  # prompt plus max_tokens of the lines that passed: what the batch holds of the queue limit

    def fail(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        self.failed_lines += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})


def _envelope(raw: bytes, number: int, endpoint: str, seen: set[str], checked: Checked) -> tuple[str, dict] | None:
    """The line's custom_id and body, or None with its error noted."""
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        checked.fail(number, "invalid_json_line", f"Line {number} is not valid JSON.")
        return None
    if not isinstance(line, dict):
        checked.fail(number, "invalid_json_line", f"Line {number} is not a JSON object.")
        return None
    custom_id, url, body = line.get("custom_id"), line.get("url"), line.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        checked.fail(number, "invalid_custom_id",
                     f"Line {number}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters.", "custom_id")
        return None
    if custom_id in seen:
        checked.fail(number, "duplicate_custom_id",
                     f"Line {number}: the custom_id {custom_id!r} is used by an earlier line; each must be unique.",
                     "custom_id")
        return None
    seen.add(custom_id)
    if line.get("method", "POST") != "POST":
        checked.fail(number, "invalid_method", f"Line {number}: 'method' must be 'POST'.", "method")
        return None
    if url != endpoint:
        checked.fail(number, "mismatched_url",
                     f"Line {number}: its url {url!r} differs from the batch's endpoint {endpoint!r}.", "url")
        return None
    if not isinstance(body, dict):
        checked.fail(number, "invalid_body", f"Line {number}: 'body' must be a JSON object.", "body")
        return None
    if body.get("stream"):
        checked.fail(number, "invalid_body", f"Line {number}: a batch line cannot stream; remove 'stream'.",
                     "body.stream")
        return None
    return custom_id, body


async def check_body(gw: Gateway, endpoint: Endpoint, body: dict, tenant, request_id: str):
    """The live endpoint's checks of one body, for a batch line (its tier ``batch``); returns its ``Prepared``."""
    req = endpoint.parse(body)
    adapter = resolve_adapter(req.model, tenant, gw.engine)
    return await prepare(gw, req, tenant, BATCH_TIER, adapter, request_id)


async def check_line(gw: Gateway, tenant, endpoint: str, number: int, raw: bytes, seen: set[str],
                     checked: Checked) -> LineSpec | None:
    """One line of the file checked; its LineSpec if it passed, else None with its error noted in ``checked``.
    ``seen`` holds the custom_ids of the lines before it."""
    envelope = _envelope(raw, number, endpoint, seen, checked)
    if envelope is None:
        return None
    custom_id, body = envelope
    try:
        prepared = await check_body(gw, ENDPOINTS[endpoint], body, tenant, f"validate-{number}")
    except APIError as e:
        checked.fail(number, e.code or "invalid_request", f"Line {number}: {e.message}",
                     f"body.{e.param}" if e.param else "body")
        return None
    checked.passed_lines += 1
    checked.tokens += prepared.reserved_tokens
    return LineSpec(number, custom_id, json.dumps(body), prepared.reserved_tokens)
