"""How much a response may repeat of its prompt, and writing a large response body off the event loop.

A prompt's scores (vLLM's ``prompt_logprobs``, completions' ``echo`` with
``logprobs``) are one entry per prompt token and alternative. Chat answers them
once, at the top of the response; completions, as vLLM and OpenAI do, in each
choice, so ``n`` multiplies them: a few kilobytes of request could ask for tens of
megabytes of answer. A response may hold as many prompt-score entries as one copy
for the longest prompt with the most alternatives (``max_model_len`` times
``MAX_PROMPT_LOGPROBS + 1``), whatever its ``n``; more is a 400 naming the
parameter. A body with many entries is built and encoded on a worker thread, in
slices, so neither the event loop nor, through the GIL, anyone else waits for it.
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from starlette.responses import Response

from gateway.errors import invalid_param
from gateway.schemas import MAX_PROMPT_LOGPROBS, GenerationRequest

# Entries (a score or an alternative) above which a body is built and encoded off the event loop.
OFF_LOOP_ENTRIES = 4096
# Items of a list encoded by one json.dumps call: between calls a thread lets others have the GIL.
_SLICE = 256


def prompt_score_entries(req: GenerationRequest, prompt_tokens: int) -> tuple[int, str | None]:
    """How many prompt-score entries the response holds, and the parameter that asks for the most of them."""
    asked = [(0, None)]
    if req.prompt_logprobs is not None:
        copies = 1 if req.kind == "chat" else req.n
        asked.append((copies * prompt_tokens * (req.prompt_logprobs + 1), "prompt_logprobs"))
    if req.echo and req.logprobs is not None:
        asked.append((req.n * prompt_tokens * (req.logprobs + 1), "echo"))
    return sum(e for e, _ in asked), max(asked, key=lambda a: a[0])[1]


def check_prompt_scores(req: GenerationRequest, prompt_tokens: int, max_model_len: int) -> None:
    """400 when the response would repeat more prompt scores than one copy for the longest prompt holds."""
    entries, param = prompt_score_entries(req, prompt_tokens)
    limit = max_model_len * (MAX_PROMPT_LOGPROBS + 1)
    if param is not None and entries > limit:
        raise invalid_param(param, f"Invalid value for '{param}': with n={req.n} and {prompt_tokens} prompt tokens "
                            f"the response would hold {entries} prompt scores, more than the {limit} one response "
                            "may hold; ask for fewer alternatives, a smaller n, or the prompt's scores on "
                            "/v1/chat/completions, which gives them once.", "invalid_value")


def encode_json(obj: Any) -> bytes:
    """The bytes of starlette's JSONResponse for ``obj``, written a slice of each long list at a time."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode("utf-8")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _encode(obj: Any, out: list[str]) -> None:
    if isinstance(obj, dict):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode(value, out)
        out.append("}")
    elif isinstance(obj, list) and len(obj) > _SLICE:
        out.append("[")
        for start in range(0, len(obj), _SLICE):
            out.append(("," if start else "") + _dumps(obj[start:start + _SLICE])[1:-1])
        out.append("]")
    elif isinstance(obj, list):
        out.append("[")
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        out.append(_dumps(obj))


async def json_response(build, entries: int, headers: dict[str, str] | None = None) -> Response:
    """``build()``'s body as a JSON response; built and encoded on a worker thread when it has many entries."""
    if entries <= OFF_LOOP_ENTRIES:
        return Response(_dumps(build()).encode("utf-8"), media_type="application/json", headers=headers)
    content = await anyio.to_thread.run_sync(lambda: encode_json(build()))
    return Response(content, media_type="application/json", headers=headers)
