"""The engine thread: take in what callers sent, ask the scheduler for a plan, run it, hand out tokens.

``_run_step`` reads as the step's phases, one method each: begin (the step's clock, what an express step inside it
may use), prepare rows (drafts, the batch's LoRA adapters, prompts to score), forward, choose tokens (penalties,
grammars, sampling, verifying drafts), account (the step metered before any of its requests ends), update the
scheduler, detokenize, hand out (publish, then send the deltas).

A light tenant's short request (the policy's ``express``) does not wait for other tenants' work: between two layers
of a step under way the loop may run an express step of it whole (engine/express_steps.py: when, and what). At a
step boundary, such a request gets a step of its own before the next (never two in a row).

An exception inside a step's forward pass fails that step's requests and the loop keeps serving; a failure confined
to one request's sampling or detokenizing ends that request alone. What callers on other threads read of the
engine's state (load, KV usage, ...) is a snapshot this thread publishes after each change.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.events import EngineEvent, Listener, StepDrafts, step_event
from engine.express_steps import StepUnderWay, plan_between_layers
from engine.grammar import mask_logits
from engine.in_flight import InFlight, Outgoing
from engine.inbox import AbortRequest, AddRequest, Inbox, Message, UnregisterAdapter
from engine.logit_adjustments import adjust_logits_, adjusts_logits
from engine.lora_hook import LoraBatchLike
from engine.request import MASK_OVER_BUDGET
from engine.prompt_scoring import PromptRows, rows_to_score, score_prompts
from engine.runner import ModelRunner
from engine.request_state import OutsideGrammar
from engine.sampler import SampledToken, sample
from engine.speculative import Speculator, accepted_drafts
from engine.step_calibration import Calibration, calibrate
from engine.step_timer import StepTimer
from engine.tokenizer import TextTokenizer
from scheduler import ScheduledChunk, Scheduler, StepPlan, TierLoad

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle loop still looks at its stop flag this often

@dataclass
class _Step:
    """One step as its phases hand it on."""

    plan: StepPlan
    nested: bool  # an express step run between the layers of another
    sampling: list[ScheduledChunk]  # the chunks that sample a token, in the order of the logits' rows
    started_at: float
    timer: StepTimer
    under_way: StepUnderWay | None  # the step's own record for express steps; None when nested


@dataclass
class _Rows:
    """What the forward reads beside the plan (``StepLoop._prepare_rows``)."""

    lora_batch: LoraBatchLike | None  # the step's chunks' adapters, None without a LoRA pool
    scoring: list[PromptRows]  # the prompts this step scores
    hidden_rows: list[int]  # the rows whose final hidden states the scoring reads


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's state as of the last change, for callers on other threads."""

    load: dict[str, TierLoad]
    kv_used: dict[str, int]  # KV blocks by tier
    spread: dict[str, float]  # fair share counter spread by tier
    adapters: tuple[frozenset[str], frozenset[str]]  # LoRA adapters of running and of waiting requests


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, lora_pool, tokenizer: TextTokenizer,
                 max_model_len: int, timer: StepTimer, inbox: Inbox, express_steps: bool = True,
                 grammar_mask_budget_s: float | None = None, speculator: Speculator | None = None,
                 calibrate_step_cost: bool = True) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.lora_pool = lora_pool
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._timer = timer
        self._inbox = inbox
        self.listeners: list[Listener] = []
        self.requests = InFlight(scheduler, self.emit, self.publish)
        self.snapshot = Snapshot(scheduler.load(), {}, {}, (frozenset(), frozenset()))
        self.busy_seconds = 0.0  # sum of step durations, for metering checks
        self.express_steps = express_steps  # the policy picks express requests (tiered with fair share)
        self._express_timer = StepTimer(timer.device)
        self._deferred: list[Message] = []  # taken between layers, handled after the step
        self._between: StepUnderWay | None = None
        self._express_ran = False  # the last step was an express step of its own
        self.grammar_mask_budget_s = grammar_mask_budget_s  # CPU seconds one row's mask may take
        self.speculator = speculator  # speculative decoding (engine/speculative.py), or None
        self.calibrate_step_cost = calibrate_step_cost  # time the step cost's prior first (engine/step_calibration.py)
        self.calibration: Calibration | None = None  # what that timed, once the loop has started
        self.started = threading.Event()  # set once calibrated, before the first step

    def run(self, stopping: threading.Event) -> None:
        torch.set_grad_enabled(False)
        if self.calibrate_step_cost:
            try:
                self.calibration = calibrate(self.scheduler, self.runner, self._timer, self.tokenizer)
            except Exception:  # the configured prior serves, as it did before calibration
                log.exception("step cost calibration failed; the configured prior is kept")
        self.started.set()
        while not stopping.is_set():
            try:
                changed = self._take_inbox()
                if self.express_steps and not self._express_ran:
                    express = self.scheduler.schedule_express()  # its own step first, never two in a row
                    if not express.is_empty:
                        self._express_ran = True
                        self._run_step(express)
                        continue
                self._express_ran = False
                plan = self.scheduler.schedule()
                if plan.is_empty:
                    if changed:  # else the last step or finish already published this state
                        self.publish()
                    self._inbox.wait(IDLE_WAIT_S)
                    continue
                self._run_step(plan)
            except Exception:  # a bug outside the forward pass: fail what is in flight, keep serving
                log.exception("engine loop iteration failed")
                self.requests.end_all("error", "error", error="internal engine error")
        self._take_inbox()
        self.requests.end_all("cancelled", "abort")

    def _take_inbox(self) -> bool:
        """Take in what callers sent; whether there was anything."""
        messages = self._deferred + self._inbox.take_all()
        self._deferred = []
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self.requests.abort(message.request_id)
            else:
                self._unregister(message)
        return bool(messages)

    def _add(self, message: AddRequest) -> None:
        state = message.state
        adapter = state.request.adapter
        if message.error is not None:
            self.requests.refuse(state, str(message.error))
        elif adapter is not None and adapter not in self.lora_pool.list():
            self.requests.refuse(state, f"adapter {adapter!r} was unloaded")
        elif state.request_id in self.requests:
            self.requests.refuse(state, f"request id {state.request_id!r} is already in flight")
        else:
            try:
                self.requests.add(state)
            except ValueError as exc:  # checked at admission too; never let it take the loop down
                self.requests.refuse(state, str(exc))

    def _unregister(self, message: UnregisterAdapter) -> None:
        done: Future[None] = message.done
        for seq_id in self.requests.seq_ids(adapter=message.name):
            self._fail(seq_id, f"adapter {message.name!r} was unloaded")
        try:
            self.lora_pool.unregister(message.name)
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _between_layers(self) -> None:
        """Between two layers of the step under way: take in new requests and run an express step if one
        qualifies; after one, run decode steps of what it started as their bound nears."""
        under_way = self._between
        if under_way is None:
            return
        plan = plan_between_layers(under_way, self.scheduler, self._take_arrivals, may_admit=not self._deferred)
        if plan.is_empty:
            return
        try:
            self._run_step(plan, nested=True)
        except Exception:  # a bug after its forward pass: end the express step's requests, not the step under way's
            log.exception("express step failed")
            for chunk in plan.chunks:
                self._fail(chunk.seq.seq_id, "internal engine error")
        finally:
            under_way.express_ended_at = time.monotonic()

    def _take_arrivals(self) -> bool:
        """Between layers: add the inbox's new requests, and say whether any message came; aborts and unloads
        touch the step under way, so they and everything after them wait for its end."""
        if not self._inbox.has_messages():
            return False
        for i, message in enumerate(messages := self._inbox.take_all()):
            if not isinstance(message, AddRequest):
                self._deferred.extend(messages[i:])
                break
            self._add(message)
        return True

    def _run_step(self, plan: StepPlan, nested: bool = False) -> None:
        """Run, sample and hand out one step (``nested``: an express step between another's layers)."""
        step = self._begin(plan, nested)
        try:
            rows = self._prepare_rows(step)
            logits = self._forward(step, rows)
            runs = self._choose_tokens(logits, step.sampling)
        except Exception as exc:  # a bad step must not take the loop down
            log.exception("engine step failed")
            self._account(step)
            for chunk in plan.chunks:
                self._fail(chunk.seq.seq_id, str(exc))
            return
        # The step is accounted before any request of it ends, so billing sees its share of the
        # step before its finish event.
        self._account(step, runs)
        outgoing: Outgoing = []
        produced = self._update_scheduler(step, runs, outgoing)
        self._detokenize(produced, outgoing)
        self._hand_out(outgoing)

    def _begin(self, plan: StepPlan, nested: bool) -> _Step:
        """Start the step's clock; a step of its own lets an express step run between its layers."""
        timer = self._express_timer if nested else self._timer
        under_way = None
        if not nested:
            under_way = StepUnderWay.of(plan)
            self._between = under_way
        step = _Step(plan, nested, [c for c in plan.chunks if c.samples], time.time(), timer, under_way)
        timer.start()
        return step

    def _prepare_rows(self, step: _Step) -> _Rows:
        """What the forward needs beside the plan: drafts for decode chunks, the batch's LoRA
        adapters, and the prefill rows whose hidden states score a prompt."""
        plan = step.plan
        if self.speculator is not None and not step.nested:  # an express step is prefill only
            self.speculator.draft(plan, self.requests.get)
        lora_batch = None
        if self.lora_pool is not None:
            lora_batch = self.lora_pool.batch_for([(c.seq.adapter, c.num_tokens) for c in plan.chunks])
        scoring, hidden_rows = rows_to_score(plan.chunks, self.requests.get)
        return _Rows(lora_batch, scoring, hidden_rows)

    def _forward(self, step: _Step, rows: _Rows) -> torch.Tensor:
        """The model over the step's rows: the sampling rows' logits; prompts to score are scored."""
        between = self._between_layers if self.express_steps and not step.nested else None
        logits, hidden = self.runner.execute_with_hidden(step.plan, rows.hidden_rows, rows.lora_batch, between,
                                                         step.nested)
        if rows.scoring:
            score_prompts(hidden, rows.scoring, self.runner.head_logits, self.tokenizer, between)
        return logits

    def _choose_tokens(self, logits: torch.Tensor, sampling: list[ScheduledChunk]) -> list[list[SampledToken]]:
        """Each sampling chunk's tokens: one, or its accepted drafts and one (engine/speculative.py);
        penalties and grammars apply first. A row whose mask ran over its budget carries the error."""
        states = [self.requests.get(c.seq.seq_id) for c in sampling]
        if any(c.draft_token_ids for c in sampling):
            runs, too_slow = self.speculator.sample(logits, sampling, states, self.tokenizer.eos_token_ids,
                                                    self.grammar_mask_budget_s)
        else:
            params = [s.request.params for s in states]
            if any(adjusts_logits(p) for p in params):
                adjust_logits_(logits, params, [s.prompt_ids if p.repetition_penalty != 1.0 else None
                                                for s, p in zip(states, params)],
                               [s.seq.output_token_ids for s in states], self.tokenizer.eos_token_ids)
            too_slow = mask_logits(logits, [s.grammar for s in states], self.grammar_mask_budget_s)
            runs = [[token] for token in sample(logits, params, [s.generator for s in states])]
        for row in too_slow:  # that request alone ends, billed for its steps so far
            runs[row] = [dataclasses.replace(runs[row][-1], error=MASK_OVER_BUDGET)]
        return runs

    def _account(self, step: _Step, runs: list[list[SampledToken]] | None = None) -> None:
        """Stop the step's clock and meter it (``runs`` None: the step failed before its tokens)."""
        duration = self._stop(step.timer, step.under_way)
        drafts = None
        if runs is not None and self.speculator is not None and not step.nested:  # an express step drafts nothing
            drafts = self.speculator.observe(step.sampling, runs, duration)
        self._account_step(step.plan, step.started_at, duration, drafts)

    def _update_scheduler(self, step: _Step, runs: list[list[SampledToken]], outgoing: Outgoing
                          ) -> list[tuple[ScheduledChunk, list[SampledToken]]]:
        """Append the step's tokens to its sequences; the chunks whose tokens came, each with its run.
        A row that failed ends its request first, so the update skips the sequence it no longer knows."""
        produced = []
        for chunk, run in zip(step.sampling, runs):
            if run[-1].error is None:
                produced.append((chunk, run))
            else:
                log.error("request %s: %s", chunk.seq.seq_id, run[-1].error)
                self._fail(chunk.seq.seq_id, run[-1].error, outgoing)
        self.scheduler.update(step.plan, {c.seq.seq_id: run[-1].token_id for c, run in produced},
                              accepted_drafts(produced))
        return produced

    def _detokenize(self, produced: list[tuple[ScheduledChunk, list[SampledToken]]], outgoing: Outgoing) -> None:
        """Each request's delta from its new tokens, into ``outgoing``; a request that finished ends."""
        for chunk, run in produced:
            seq_id = chunk.seq.seq_id
            state = self.requests.get(seq_id)
            if state is None:  # a sibling choice failed earlier in this step and took it along
                continue
            if state.group is not None and state.group.waiting:
                self.requests.release_siblings(state)
            try:
                delta = state.on_tokens(run, self.tokenizer, self.max_model_len)
            except OutsideGrammar:
                self._fail(seq_id, "the sampled token is outside the request's grammar", outgoing)
                continue
            except Exception as exc:  # e.g. the detokenizer: this request's failure, not its batch's
                log.exception("request %s: building its output failed", state.request_id)
                self._fail(seq_id, f"detokenizing failed: {exc}", outgoing)
                continue
            if delta.finish_reason is None:
                outgoing.append((state.sink, delta))
            else:
                self.requests.end(seq_id, "ok", delta.finish_reason, last_delta=delta, outgoing=outgoing)

    def _hand_out(self, outgoing: Outgoing) -> None:
        """Publish the new state, then send the step's deltas: after all of its bookkeeping, as a
        caller woken by one needs the GIL, which this thread would otherwise hold through it."""
        self.publish()
        for sink, delta in outgoing:
            sink(delta)

    def _fail(self, seq_id: str, error: str, outgoing: Outgoing | None = None) -> None:
        """End one request with an error (its delta into ``outgoing`` when the step is handing out)."""
        self.requests.end(seq_id, "error", "error", error=error, outgoing=outgoing)

    def _stop(self, timer: StepTimer, under_way: StepUnderWay | None) -> float:
        """The step's metered seconds: an express step run inside it is metered (and billed) as its own."""
        elapsed = timer.stop()
        if under_way is None:  # an express step: the step it ran inside leaves these seconds to it
            if self._between is not None:
                self._between.express_s = (self._between.express_s or 0.0) + elapsed
            return elapsed
        self._between = None
        return max(0.0, elapsed - (under_way.express_s or 0.0))

    def _account_step(self, plan: StepPlan, started_at: float, duration: float,
                      drafts: StepDrafts | None = None) -> None:
        self.busy_seconds += duration
        prefill_tokens = sum(c.num_tokens for c in plan.chunks if c.num_tokens - len(c.draft_token_ids) > 1)
        self.scheduler.observe_step(duration, plan.num_tokens, prefill_tokens, plan)
        self.emit(step_event(plan, started_at, duration, self.requests.request_id_of, drafts))

    def publish(self) -> None:
        kv_used, _ = self.scheduler.kv_usage()
        self.snapshot = Snapshot(self.scheduler.load(), kv_used, self.scheduler.counter_spread(),
                                 self.scheduler.adapter_usage())

    def emit(self, event: EngineEvent) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("engine event listener failed")
