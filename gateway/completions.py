"""POST /v1/chat/completions and /v1/completions: the admission path from bytes to an engine request.

Every endpoint that generates takes this one path (``generate`` with its ``Endpoint``); the Responses
API (gateway/responses_api.py) is a chat request on it with a framing of its own.

A request goes parse, build, admit, respond (``_serve``). Order matters: cheap
checks that touch nothing come first (draining, key, then at most the tenant's
concurrency limit of its requests being read and built at once, then body, model,
context length: ``prepare``), then admission (gateway/admission.py: the load shedder,
which reserves nothing, then the rate limits and budgets, which reserve), then
the grammar's compile (paid from that budget, gateway/grammar_budget.py), and
only then the engine. Two refusals come before admission and are counted
against the tenant's RPM, so that they are not free to send: one for its prompt
(gateway/prompts.py), and a grammar its tenant has no compile slot for, checked
as soon as the body is parsed so that a flood of grammars costs no tokenizing.
Every refusal after the key is known (400, 404, 413, 429, 503) writes the
request's one ledger row, status ``rejected``, through one ``Refusal``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engine.request import Delta, EngineRequest, SamplingParams
from engine.validation import InvalidRequest
from gateway.admission import count_refusal, refuse, release, reserve
from gateway.errors import APIError, model_not_found, service_unavailable
from gateway.generation import AdmittedRequest, Generation, GenerationStream
from gateway.grammar_budget import check_compile_room, compile_grammar
from gateway.http_protocol import ON_DISCONNECT
from gateway.lifecycle import DRAIN_RETRY_S
from gateway.logs import request_context
from gateway.prompt_lists import list_token_ids
from gateway.ratelimit.base import retry_headers
from gateway.response_size import check_prompt_scores
from gateway.schemas import GenerationRequest, parse_chat, parse_completion, parse_json_body
from gateway.services import EngineFront, Gateway
from gateway.tenant_slots import HeldSlot
from gateway.usage_recorder import Refusal, RequestIdentity

log = logging.getLogger(__name__)

# Retry-After of a request refused because its tenant has as many being admitted as it may have.
READING_RETRY_S = 1.0

async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "The client closed the connection before sending the whole body.") from None
    return b"".join(chunks)


def resolve_adapter(model: str, tenant, engine) -> str | None:
    """None for the base model, else the adapter's name; 404 for anything the tenant may not use."""
    if model == engine.model_name:
        return None
    if model in tenant.adapters and model in engine.list_adapters():
        return model
    raise model_not_found(model)


def default_max_tokens(prompt_len: int, max_model_len: int, default: int) -> int:
    """max_tokens for a request that names none: the default, or what room the context leaves."""
    return max(1, min(default, max_model_len - prompt_len))


def prompt_scores_wanted(req: GenerationRequest) -> int | None:
    """How many alternatives the engine scores each prompt token with; None: it scores none.

    ``echo`` with ``logprobs`` shows the prompt's tokens with the same logprobs as the completion's."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted, default=None)


def echo_texts(req: GenerationRequest, prompts: list[list[int]], tokenizer) -> tuple[str, ...]:
    """Each prompt as ``echo`` gives it back: the client's own text, or its token ids decoded."""
    given = (req.prompt, *req.more_prompts)
    return tuple(p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(given, prompts))


async def prompt_token_ids(gw: Gateway, req: GenerationRequest) -> list[list[int]]:
    """The token ids of each of the request's prompts (one, unless a list prompt)."""
    if not req.more_prompts:
        return [await gw.prompts.token_ids(req)]
    return await list_token_ids(gw.prompts, (req.prompt, *req.more_prompts), gw.settings.max_prompt_list_tokens)


def check_request(engine: EngineFront, request: EngineRequest, max_tokens_given: bool) -> None:
    """The engine's own checks (engine/validation.py), as a 400; run before any limit is reserved."""
    try:
        engine.check(request)
    except InvalidRequest as e:
        # Without a max_tokens of the client's, a context too short is the prompt's fault.
        param = "messages" if e.code == "context_length_exceeded" and not max_tokens_given else e.param
        raise APIError(400, str(e), param=param, code=e.code) from None


def _plain_generation(admitted: AdmittedRequest, stream: AsyncIterator[Delta], gw: Gateway, trace,
                      req: GenerationRequest) -> Generation:
    return Generation(admitted, stream, gw, trace)


@dataclass(frozen=True)
class Endpoint:
    """What differs between the endpoints that generate: how a body parses, request ids, the trace's
    operation, and what frames the answer (gateway/generation.py's chat or completion objects, or another
    framing built on them, such as gateway/responses_api.py's)."""

    kind: str  # "chat" or "completion": the GenerationRequest and the Generation's framing
    parse: Callable[[dict[str, Any]], GenerationRequest]
    id_prefix: str
    operation: str  # OpenTelemetry's gen_ai.operation.name
    generation: Callable[..., Generation] = _plain_generation  # (admitted, stream, gw, trace, req)


CHAT = Endpoint("chat", parse_chat, "chatcmpl-", "chat")
COMPLETION = Endpoint("completion", parse_completion, "cmpl-", "text_completion")


async def chat_completions(request: Request) -> Response:
    return await generate(request, CHAT)


async def completions(request: Request) -> Response:
    return await generate(request, COMPLETION)


async def generate(request: Request, endpoint: Endpoint) -> Response:
    """The one admission path of every endpoint that generates: the key, then ``_serve``."""
    gw: Gateway = request.app.state.gateway
    arrived, queued_at = time.monotonic(), time.time()
    if gw.lifecycle.draining:
        raise service_unavailable("The server is shutting down; retry on another replica.",
                                  headers=retry_headers(DRAIN_RETRY_S))
    tenant = await gw.auth.authenticate(request)
    request_id = f"{endpoint.id_prefix}{gw.ids.getrandbits(128):032x}"
    # From here every refusal, whichever check makes it, leaves the request's one ledger row.
    refusal = Refusal(gw.usage, RequestIdentity(request_id, tenant.tenant, tenant.tier, None, queued_at))
    try:
        reading = _reading_slot(gw, tenant)
        try:
            return await _serve(request, endpoint, gw, tenant, refusal, arrived, reading)
        finally:
            reading.give_back()
    except APIError:
        refusal.record()
        raise
    except Exception:
        refusal.record("error")
        raise


def _reading_slot(gw: Gateway, tenant) -> HeldSlot:
    """One of the tenant's slots for a request between its key and its admission; 429 when all are taken.

    Reading, parsing and tokenizing a body runs on the event loop and grows with the body: a tenant has at
    most its concurrency limit of them under way, so a flood of large bodies is refused before they are read
    (the limiter would refuse all but that many after reading them)."""
    limit = max(1, tenant.max_concurrent)
    if not gw.reading_slots.take(tenant.tenant, limit):
        raise refuse(gw, tenant.tier, "concurrency", APIError(
            429, f"Too many requests from this key are being admitted at once: limit {limit}. Retry shortly.",
            type="requests", code="rate_limit_exceeded", headers=retry_headers(READING_RETRY_S)))
    return HeldSlot(gw.reading_slots, tenant.tenant)


@dataclass(frozen=True)
class Prepared:
    """A body that passed every check the endpoints that generate run on it, as the engine request it became."""

    req: GenerationRequest
    prompts: list[list[int]]  # each prompt's token ids (one, unless a list prompt)
    max_tokens: int
    engine_request: EngineRequest

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def reserved_tokens(self) -> int:
        """Its worst case: the prompts, and max_tokens for every choice of every prompt."""
        return self.prompt_tokens + len(self.prompts) * self.req.n * self.max_tokens


async def prepare(gw: Gateway, req: GenerationRequest, tenant, tier: str, adapter: str | None,
                  request_id: str) -> Prepared:
    """The one definition of a body's checks past its parse and model (prompt size, context, the engine's own),
    as 400s: the live endpoints run it at admission, the Batch API on every line of a file and again as it runs it."""
    gw.prompts.check_size(req)  # before any cost that grows with the prompt: the template's, the tokenizer's
    prompts = await prompt_token_ids(gw, req)
    check_prompt_scores(req, sum(map(len, prompts)), gw.engine.max_model_len)
    max_tokens = req.max_tokens or default_max_tokens(max(map(len, prompts)), gw.engine.max_model_len,
                                                      gw.settings.default_max_tokens)
    # Sampling's fields carry SamplingParams' own names.
    params = SamplingParams(max_tokens=max_tokens, **vars(req.sampling), stop=req.stop,
                            stop_token_ids=req.stop_token_ids, logprobs=req.logprobs, ignore_eos=req.ignore_eos,
                            grammar=req.grammar, n=req.n, prompt_logprobs=prompt_scores_wanted(req))
    engine_request = EngineRequest(request_id, prompts[0], params, tier, adapter, tenant=tenant.tenant,
                                   tenant_weight=tenant.weight, more_prompts=tuple(prompts[1:]),
                                   speculative=req.speculative)
    check_request(gw.engine, engine_request, req.max_tokens is not None)
    return Prepared(req, prompts, max_tokens, engine_request)


def admitted_request(gw: Gateway, endpoint: Endpoint, prepared: Prepared, queued_at: float,
                     arrived: float) -> AdmittedRequest:
    """What the generation of a prepared request needs to frame its answer as the endpoint does."""
    req, request = prepared.req, prepared.engine_request
    return AdmittedRequest(
        request_id=request.request_id, tenant=request.tenant, tier=request.tier, adapter=request.adapter,
        queued_at=queued_at, kind=endpoint.kind, model=req.model, arrived=arrived,
        prompt_tokens=prepared.prompt_tokens, reserved_tokens=prepared.reserved_tokens, prompts=len(prepared.prompts),
        want_logprobs=req.logprobs is not None, include_usage=req.include_usage,
        parse_tool_calls=req.tools is not None and req.tools.choice != "none", n=req.n,
        top_logprobs=req.logprobs or 0, prompt_logprobs=req.prompt_logprobs,
        echo_texts=echo_texts(req, prepared.prompts, gw.prompts.tokenizer) if req.echo else (),
        grammar_param=req.grammar_param if req.grammar is not None else None,
    )


async def _serve(request: Request, endpoint: Endpoint, gw: Gateway, tenant, refusal: Refusal,
                 arrived: float, reading: HeldSlot) -> Response:
    """Parse, build, admit, respond; a refusal at any of them is raised (its row: ``generate``'s ``Refusal``).
    ``reading``: the tenant's slot for it until its admission."""
    # Parse: the body, and the model it names (the base model, or an adapter the tenant may use).
    req = endpoint.parse(parse_json_body(await read_body(request, gw.settings.max_body_bytes)))
    refusal.who = who = dataclasses.replace(refusal.who, adapter=resolve_adapter(req.model, tenant, gw.engine))
    # Build: the engine request, checked as the engine will check it.
    try:
        if req.grammar is not None:  # its compile could not start: refused before its prompt costs anything
            check_compile_room(gw, tenant, req.grammar, req.grammar_param)
        prepared = await prepare(gw, req, tenant, who.tier, who.adapter, who.request_id)
    except APIError:
        await count_refusal(gw, tenant, who.request_id)
        raise
    admitted = admitted_request(gw, endpoint, prepared, who.queued_at, arrived)
    # Admit: load, rate limits, budgets; then the grammar's compile, paid from them as the tokens are.
    decision = await reserve(gw, admitted, tenant)
    reading.give_back()  # admitted: from here the rate limiter's concurrency slot counts it
    if req.grammar is not None:
        prepared = await _with_grammar(gw, tenant, admitted, prepared)
    # Respond. The headers are built before the engine has the request: from then on this thread holds
    # the GIL the engine thread needs for its step, until it awaits the first delta.
    headers = {"x-request-id": who.request_id, **decision.headers()}
    return await _respond(request, endpoint, gw, prepared, admitted, refusal, headers)


async def _with_grammar(gw: Gateway, tenant, admitted: AdmittedRequest, prepared: Prepared) -> Prepared:
    """The request with its grammar compiled (gateway/grammar_budget.py); a refusal gives its limits back."""
    req = prepared.req
    try:
        compiled = await compile_grammar(gw, tenant, admitted.request_id, req.grammar, req.grammar_param)
    except BaseException:  # refused, or the client left: either way the slot and tokens go back
        with anyio.CancelScope(shield=True):
            try:
                await release(gw, admitted)
            except Exception:  # an outage must not turn the 400 into a 500; leases and holds expire by themselves
                log.exception("rate limiter or budget release failed for %s", admitted.request_id)
        raise
    request = dataclasses.replace(prepared.engine_request, compiled_grammar=compiled)
    return dataclasses.replace(prepared, engine_request=request)


async def _respond(request: Request, endpoint: Endpoint, gw: Gateway, prepared: Prepared, admitted: AdmittedRequest,
                   refusal: Refusal, headers: dict[str, str]) -> Response:
    """Hand the request to the engine and answer it: a stream of SSE chunks, or one JSON body at its end."""
    req, sampling = prepared.req, prepared.req.sampling
    trace = gw.tracing.start_request(
        request_id=admitted.request_id, operation=endpoint.operation, model=req.model,
        tenant=admitted.tenant, tier=admitted.tier, adapter=admitted.adapter, max_tokens=prepared.max_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
        presence_penalty=sampling.presence_penalty or None, frequency_penalty=sampling.frequency_penalty or None,
        seed=sampling.seed, stream=req.stream, headers=request.headers,
    )
    with request_context(admitted.request_id, tenant=admitted.tenant, tier=admitted.tier, trace_id=trace.trace_id):
        stream = await _submit(gw, admitted, prepared.engine_request, trace)
        generation = endpoint.generation(admitted, stream, gw, trace, req)
        refusal.admitted()  # from now on the generation owns the row
        generation.row_opened = gw.usage.open(admitted, admitted.prompt_tokens, lambda: generation.completion_tokens,
                                              now=req.stream)
        if req.stream:
            return GenerationStream(generation, headers)
        # Starlette notices a client that leaves only on streams; the server's disconnect hook
        # (gateway/http_protocol.py) tells us here, and the abort ends the collection as a
        # cancelled request: blocks freed within a step, billed with the tokens made.
        # Under a server without the hook the request runs to its end.
        on_disconnect = request.scope.get("extensions", {}).get(ON_DISCONNECT)
        if on_disconnect is not None:
            on_disconnect.append(functools.partial(gw.engine.abort, admitted.request_id))
        return await generation.collect(headers)


async def _submit(gw: Gateway, admitted: AdmittedRequest, request: EngineRequest, trace) -> AsyncIterator[Delta]:
    gw.usage.begin(admitted)
    trace.mark_submitted()
    try:
        return gw.engine.submit(request)
    except Exception as e:
        # The engine's checks passed above; reaching here is a race (an adapter unloaded this
        # instant) or a bug. Give everything back and bill nothing.
        gw.usage.meter.forget(admitted.request_id)
        trace.finish(error=str(e))
        await release(gw, admitted)
        if admitted.adapter is not None and admitted.adapter not in gw.engine.list_adapters():
            raise model_not_found(admitted.model) from None
        if isinstance(e, InvalidRequest):
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        raise
