"""One admitted request's life in the engine: deltas to SSE or JSON, its ledger row, its limits given back.

Whatever way the request ends (finished, client gone, server stopping),
``close()`` runs exactly once: it aborts the engine request if it is still
running (freeing its KV blocks within a step), and makes sure the ledger row
is written and the unused token reservation and the concurrency slot go back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

import anyio
import anyio.to_thread
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from billing.usage_record import UsageRecord
from engine.request import MASK_OVER_BUDGET, Delta, TokenLogprob, Usage
from gateway import openai_format as fmt
from gateway.errors import APIError, invalid_param
from gateway.lifecycle import DRAIN_RETRY_S
from gateway.logs import request_context
from gateway.ratelimit.base import retry_headers
from gateway.response_size import OFF_LOOP_ENTRIES, json_response
from gateway.tool_calls import ToolCallParser, finish_reason_with_calls, split_tool_calls
from gateway.usage_recorder import RequestIdentity, gateway_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmittedRequest(RequestIdentity):
    """What the admission path knows of a request it let through: whose it is, and how to frame its answer."""

    kind: str  # "chat" or "completion"
    model: str
    arrived: float  # time.monotonic() at arrival, for TTFT
    prompt_tokens: int
    reserved_tokens: int
    want_logprobs: bool
    include_usage: bool
    parse_tool_calls: bool = False  # the answer may hold tool calls (gateway/tools.py)
    n: int = 1  # choices per prompt
    top_logprobs: int = 0  # alternatives shown beside each token's logprob
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token
    # completions' echo: each prompt, given back before its choices' text; empty: no echo
    echo_texts: tuple[str, ...] = ()
    prompts: int = 1  # a list prompt's entries: choice i is choice i % n of prompt i // n
    grammar_param: str | None = None  # the parameter its grammar came from, for a mask over its budget

    @property
    def choices(self) -> int:
        return self.n * self.prompts

    def echo_of(self, index: int) -> str | None:
        return self.echo_texts[index // self.n] if self.echo_texts else None


class Generation:
    """The engine stream of one admitted request, answered as SSE (`sse`) or one JSON body (`collect`)."""

    def __init__(self, admitted: AdmittedRequest, stream: AsyncIterator[Delta], gateway, trace) -> None:
        self.admitted = admitted
        self.stream = stream
        self.gw = gateway
        self.trace = trace  # gateway.tracing.RequestTrace
        self.created = int(time.time())
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.recorded = False  # the ledger row is durable
        self.row_opened: Future[bool] | None = None  # the open row's write, set by the admission path
        self.closed = False
        self._first_token_mono: float | None = None
        self._last_delta_mono: dict[int, float] = {}  # by choice index: when its last tokens came
        self.interrupted = False  # by a drain's deadline: ends as a server shutdown
        gateway.lifecycle.enter(self)

    def interrupt(self) -> None:
        """The server is stopping: end the request now; its response says so and its row is ``interrupted``."""
        self.interrupted = True
        self.gw.engine.abort(self.admitted.request_id)

    # -- consuming deltas -------------------------------------------------

    def _on_delta(self, delta: Delta) -> None:
        if delta.token_ids and self._first_token_mono is None:
            self._first_token_mono = time.monotonic()
            self.first_token_at = time.time()
            self.gw.metrics.observe_ttft(self.admitted.tier, self._first_token_mono - self.admitted.arrived)
            self.trace.mark_first_token()
        if delta.token_ids:
            now, last = time.monotonic(), self._last_delta_mono.get(delta.index)
            if last is not None:  # the gap this choice's client waited (scheduler/step_budget.py bounds it)
                self.gw.metrics.observe_inter_token(self.admitted.tier, now - last)
            self._last_delta_mono[delta.index] = now
        self.completion_tokens += len(delta.token_ids)

    def _cut_by_shutdown(self, last: Delta) -> bool:
        return self.interrupted and last.finish_reason == "abort"

    async def _record(self, status: str, last: Delta | None = None) -> str:
        """Write the ledger row (before the response's last byte) and account the finish; returns the status."""
        fallback = gateway_record(self.admitted, status, self.admitted.prompt_tokens, self.completion_tokens,
                                  self.first_token_at)
        # The engine saw an abort; the row says why: the server stopped, not the client.
        override = "interrupted" if status == "interrupted" else None
        record = await self._final_row(fallback, override)
        self.recorded = True
        # The engine's count includes tokens made after a client left, which it never saw: they are
        # billed, and they count against the tenant's TPM when the reservation is settled.
        self.completion_tokens = max(self.completion_tokens, record.completion_tokens)
        usage = Usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
        self.trace.finish(usage=usage, finish_reason=last.finish_reason if last else "abort",
                          error=last.error if last else None)
        self.gw.metrics.count_request(self.admitted.tier, record.status)
        if self._first_token_mono is not None and self.completion_tokens > 1:
            tpot = (time.monotonic() - self._first_token_mono) / (self.completion_tokens - 1)
            self.gw.metrics.observe_tpot(self.admitted.tier, tpot)
        return record.status

    async def _final_row(self, fallback: UsageRecord, status: str | None) -> UsageRecord:
        """The request's final ledger row, durable when this returns."""
        return await self.gw.usage.finish(self.admitted.request_id, fallback, status=status)

    async def sse(self) -> AsyncIterator[bytes]:
        admitted = self.admitted
        writer = fmt.ChunkWriter(admitted.kind, admitted.request_id, self.created, admitted.model,
                                 admitted.include_usage)
        parsers: dict[int, ToolCallParser] = {}
        if self.row_opened is not None:
            # Once a client has seen a request's id, a crash must leave a row for it: the open row is
            # durable (committed or spooled) before the first chunk.
            await asyncio.wrap_future(self.row_opened)
        yield b"".join(writer.first(index) for index in range(admitted.choices))
        echoed: set[int] = set()
        prompt_scores: dict[int, tuple[TokenLogprob, ...]] = {}  # by prompt
        async for delta in self.stream:
            self._on_delta(delta)
            text, reason, index = delta.text, delta.finish_reason, delta.index
            if delta.prompt_logprobs is not None:  # on a prompt's first choice's first delta, before its siblings'
                prompt_scores[index // admitted.n] = delta.prompt_logprobs
            echo = admitted.echo_of(index)
            if echo is not None and index not in echoed:
                echoed.add(index)
                items = fmt.echo_items(prompt_scores.get(index // admitted.n, ()), admitted.top_logprobs) \
                    if admitted.want_logprobs else ()
                echo_delta = functools.partial(writer.delta, echo, items, admitted.want_logprobs, index=index)
                if len(items) * (admitted.top_logprobs + 1) > OFF_LOOP_ENTRIES:  # a long prompt's scores
                    yield await anyio.to_thread.run_sync(echo_delta)
                else:
                    yield echo_delta()
            if admitted.parse_tool_calls:
                parser = parsers.setdefault(index, ToolCallParser())
                pieces = parser.feed(text) + (parser.finish() if reason is not None else [])
                for piece in pieces:  # content and calls in the order they were written
                    if isinstance(piece, dict):
                        yield writer.tool_call(piece, index)
                    else:
                        yield writer.delta(piece, (), False, index=index)
                text = ""
                if reason is not None:
                    reason = finish_reason_with_calls(reason, parser.calls)
            if not delta.is_last:
                chunk = writer.delta(text, delta.logprobs, admitted.want_logprobs, reason, index)
                if chunk:
                    yield chunk
                continue
            if self._cut_by_shutdown(delta):
                await self._record("interrupted", delta)
                # The error is the stream's last event: no [DONE], so no client takes the text as whole.
                yield fmt.sse(shutdown_error(self.completion_tokens).body())
                return
            await self._record("error" if delta.error else "ok", delta)
            if delta.error:
                yield fmt.sse(self._failure(delta).body())
            else:
                yield writer.delta(text, delta.logprobs, admitted.want_logprobs, reason, index)
                yield writer.usage(delta.usage or self._usage())
            yield fmt.DONE
            return

    async def collect(self, headers: dict[str, str] | None = None) -> Response:
        admitted = self.admitted
        texts: dict[int, list[str]] = defaultdict(list)  # by choice index
        logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
        reasons: dict[int, str] = {}
        last: Delta | None = None
        prompt_scores: dict[int, tuple[TokenLogprob, ...]] = {}  # by prompt
        try:
            async for last in self.stream:
                self._on_delta(last)
                texts[last.index].append(last.text)
                logprobs[last.index].extend(last.logprobs)
                if last.prompt_logprobs is not None:
                    prompt_scores[last.index // admitted.n] = last.prompt_logprobs
                if last.finish_reason is not None:
                    reasons[last.index] = last.finish_reason
                if last.is_last:
                    if self._cut_by_shutdown(last):
                        await self._record("interrupted", last)
                        return shutdown_error(self.completion_tokens).response()
                    await self._record("error" if last.error else "ok", last)
                    break
        finally:
            await self.close()
        delta = last
        if delta is None or delta.error:
            return self._failure(delta).response()
        usage = delta.usage or self._usage()

        def body() -> dict:
            choices = [self._choice(i, "".join(texts[i]), reasons.get(i, delta.finish_reason), logprobs[i],
                                    prompt_scores.get(i // admitted.n, ())) for i in range(admitted.choices)]
            shown = None  # vLLM's prompt_logprobs, by prompt: the response's on chat, each choice's on completions
            if admitted.prompt_logprobs is not None:
                shown = [fmt.prompt_logprobs(prompt_scores.get(p, ()), admitted.prompt_logprobs)
                         for p in range(admitted.prompts)]
            if admitted.kind == "chat":
                out = fmt.chat_response(admitted.request_id, self.created, admitted.model, choices, usage)
                if shown is not None:
                    out["prompt_logprobs"] = shown[0]
                return out
            if shown is not None:
                for choice in choices:
                    choice["prompt_logprobs"] = shown[choice["index"] // admitted.n]
            return fmt.completion_response(admitted.request_id, self.created, admitted.model, choices, usage)

        # An upper bound of the scores and alternatives the body holds (gateway/response_size.py).
        alternatives = max(admitted.top_logprobs, admitted.prompt_logprobs or 0) + 1
        scored = sum(map(len, prompt_scores.values()))
        entries = (sum(map(len, logprobs.values())) + scored * admitted.n) * alternatives
        return await json_response(body, entries, headers)

    def _choice(self, index: int, text: str, reason: str | None, logprobs: list[TokenLogprob],
                prompt_scores: tuple[TokenLogprob, ...]) -> dict:
        admitted = self.admitted
        if admitted.kind != "chat":
            lp = None
            echo = admitted.echo_of(index)
            if admitted.want_logprobs and echo is not None:
                lp = fmt.echoed_completion_logprobs(prompt_scores, admitted.top_logprobs, len(echo), logprobs)
            elif admitted.want_logprobs:
                lp = fmt.completion_logprobs(logprobs, 0)
            return fmt.completion_choice(index, (echo or "") + text, reason, lp)
        lp = fmt.chat_logprobs(logprobs) if admitted.want_logprobs else None
        content, calls = text, None
        if admitted.parse_tool_calls:
            content, calls = split_tool_calls(text)
            reason = finish_reason_with_calls(reason, calls)
        return fmt.chat_choice(index, content, reason, lp, calls)

    def _failure(self, last: Delta | None) -> APIError:
        """The error of a request that ended without its answer (``last``: its last delta, if one came)."""
        if last is not None and last.error == MASK_OVER_BUDGET:
            return grammar_too_slow(self.admitted.grammar_param)
        return engine_error()

    def _usage(self) -> Usage:
        return Usage(prompt_tokens=self.admitted.prompt_tokens, completion_tokens=self.completion_tokens)

    # -- the end, however it comes -----------------------------------------

    async def close(self) -> None:
        """Idempotent; shielded so a cancelled (disconnected) caller still frees and bills everything."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            aclose = getattr(self.stream, "aclose", None)
            if aclose is not None:
                await aclose()  # aborts the engine request if it has not finished
            try:
                if self.recorded:
                    await self._release()
                else:
                    # The client left (or the server is stopping): the row waits for the engine's finish
                    # event of the abort, which needs no client, so it is written in the background.
                    self.gw.lifecycle.spawn(self._finish_cancelled())
            finally:
                self.gw.lifecycle.exit(self)

    async def _finish_cancelled(self) -> None:
        admitted = self.admitted
        with request_context(admitted.request_id, tenant=admitted.tenant, tier=admitted.tier,
                             trace_id=self.trace.trace_id):
            try:
                await self._record("cancelled")
            finally:
                await self._release()

    async def _release(self) -> None:
        admitted, used = self.admitted, self.admitted.prompt_tokens + self.completion_tokens
        try:
            await self.gw.limiter.release(admitted.tenant, admitted.request_id, admitted.reserved_tokens, used)
        except Exception:  # a limiter outage must not fail a finished response; the lease expires by itself
            log.exception("rate limiter release failed for %s", admitted.request_id)


def grammar_too_slow(param: str | None) -> APIError:
    """A request its grammar's mask stopped (engine/grammar.py: mask_logits): the client's grammar, not our fault."""
    return invalid_param(param or "response_format", f"Invalid value for '{param}': {MASK_OVER_BUDGET}; the "
                         "request was stopped. Use a less ambiguous grammar.", "grammar_too_slow")


def engine_error() -> APIError:
    return APIError(500, "The engine failed while generating; the request was stopped.", type="server_error",
                    code="engine_error")


def shutdown_error(tokens_sent: int) -> APIError:
    return APIError(503, f"The server is shutting down; the response was cut short after {tokens_sent} "
                    "token(s). Retry the admitted.", type="server_shutdown", code="server_shutdown",
                    headers=retry_headers(DRAIN_RETRY_S))


class GenerationStream(StreamingResponse):
    """An SSE response whose generation is closed however the response ends, even if it never started."""

    def __init__(self, generation: Generation, headers: dict[str, str]) -> None:
        super().__init__(generation.sse(), media_type="text/event-stream",
                         headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()
