"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

lm-evaluation-harness's ``local-completions`` asks ``/tokenizer_info`` first; when it answers, the
harness tokenizes through ``/tokenize`` instead of a local copy of the model's tokenizer. They run no
model, so they are neither metered nor billed, but they go through the API's own front door: the drain
check, the tenant's key, the body limit, the model (the base or an adapter the tenant may use, which
share one tokenizer), one RPM unit each (a 429 once over it, counted and recorded as any refusal), and
the list prompt's bound on tokens; text is tokenized off the event loop as prompts are.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admission import count_refusal
from gateway.completions import read_body, resolve_adapter
from gateway.errors import invalid_param, service_unavailable
from gateway.json_fields import bool_field, is_int, optional
from gateway.lifecycle import DRAIN_RETRY_S
from gateway.prompt_lists import list_token_ids
from gateway.ratelimit.base import retry_headers
from gateway.schemas import parse_chat, parse_json_body
from gateway.services import Gateway

# /tokenize's own fields; the rest of a chat-form body is a chat request's (gateway/schemas.py).
_TOKENIZE_FIELDS = {"model", "add_special_tokens", "return_token_strs"}
# Long token lists are decoded on a worker thread, as long prompts are encoded.
INLINE_DECODE_TOKENS = 8192


async def _authorized_body(request: Request, body_wanted: bool) -> tuple[Gateway, dict[str, Any]]:
    """The gateway and the body (empty for a GET), once the request may run."""
    gw: Gateway = request.app.state.gateway
    if gw.lifecycle.draining:
        raise service_unavailable("The server is shutting down; retry on another replica.",
                                  headers=retry_headers(DRAIN_RETRY_S))
    tenant = await gw.auth.authenticate(request)
    body = parse_json_body(await read_body(request, gw.settings.max_body_bytes)) if body_wanted else {}
    model = optional(body, "model")
    if model is not None:
        if not isinstance(model, str):
            raise invalid_param("model", "Invalid type for 'model': expected a string.", "invalid_type")
        resolve_adapter(model, tenant, gw.engine)
    # One RPM unit, taken as a refused request's is: it runs nothing, so it reserves no tokens.
    await count_refusal(gw, tenant, f"tok-{gw.ids.getrandbits(128):032x}")
    return gw, body


async def tokenize(request: Request) -> Response:
    gw, body = await _authorized_body(request, body_wanted=True)
    return_strs = bool_field(body, "return_token_strs")
    if optional(body, "messages") is not None:
        ids = await _chat_ids(gw, body)
    else:
        prompt = optional(body, "prompt")
        unknown = sorted(body.keys() - _TOKENIZE_FIELDS - {"prompt"})
        if unknown:
            raise invalid_param(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}",
                                "unknown_parameter")
        if not isinstance(prompt, str):
            raise invalid_param("prompt", "Invalid type for 'prompt': expected a string (or give 'messages').",
                                "invalid_type" if prompt is not None else "missing_required_parameter")
        ids = await _text_ids(gw, prompt, bool_field(body, "add_special_tokens", True))
    tokenizer = gw.engine.tokenizer
    return JSONResponse({
        "count": len(ids), "max_model_len": gw.engine.max_model_len, "tokens": ids,
        "token_strs": [tokenizer.id_to_token_text(t) for t in ids] if return_strs else None,
    })


async def _text_ids(gw: Gateway, text: str, add_special_tokens: bool) -> list[int]:
    if not text:
        return []
    if add_special_tokens:  # the same bound and pool as a list prompt's entry
        [ids] = await list_token_ids(gw.prompts, (text,), gw.settings.max_prompt_list_tokens)
        return ids
    fewest = -(-len(text) // gw.engine.tokenizer.max_token_chars)
    if fewest > gw.settings.max_prompt_list_tokens:
        raise invalid_param("prompt", f"Invalid value for 'prompt': it holds at least {fewest} tokens; at most "
                            f"{gw.settings.max_prompt_list_tokens} are tokenized in one request.", "invalid_value")
    [ids] = await gw.prompts.encode_texts([text], add_special_tokens=False)
    return ids


async def _chat_ids(gw: Gateway, body: dict[str, Any]) -> list[int]:
    """A chat-form body: its messages through the chat template, exactly as a chat request's prompt."""
    if bool_field(body, "add_special_tokens"):
        raise invalid_param("add_special_tokens", "'add_special_tokens' with 'messages' is not supported: the "
                            "chat template writes the special tokens it wants.", "unsupported_parameter")
    chat = {k: v for k, v in body.items() if k not in _TOKENIZE_FIELDS}
    req = parse_chat({**chat, "model": gw.engine.model_name})
    return await gw.prompts.token_ids(req)


async def detokenize(request: Request) -> Response:
    gw, body = await _authorized_body(request, body_wanted=True)
    unknown = sorted(body.keys() - {"model", "tokens"})
    if unknown:
        raise invalid_param(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
    tokens = optional(body, "tokens")
    vocab = gw.engine.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise invalid_param("tokens", "Invalid type for 'tokens': expected an array of token ids.",
                            "invalid_type" if tokens is not None else "missing_required_parameter")
    if not all(0 <= t < vocab for t in tokens):
        raise invalid_param("tokens", f"Token ids must be in [0, {vocab}).", "invalid_value")
    if len(tokens) > gw.settings.max_prompt_list_tokens:
        raise invalid_param("tokens", f"Invalid value for 'tokens': at most {gw.settings.max_prompt_list_tokens} "
                            "tokens are decoded in one request.", "invalid_value")
    decode = gw.engine.tokenizer.decode
    text = decode(tokens) if len(tokens) <= INLINE_DECODE_TOKENS else await anyio.to_thread.run_sync(decode, tokens)
    return JSONResponse({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    gw, _ = await _authorized_body(request, body_wanted=False)
    tokenizer = gw.engine.tokenizer
    return JSONResponse({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": gw.engine.max_model_len,
        "vocab_size": tokenizer.vocab_size,
    })


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
]
