"""The engine front and its step loop.

Callers submit requests from any thread; the loop runs on its own thread:
drain new requests and aborts -> scheduler plan -> adapters for the batch ->
one forward pass over mixed prefill chunks and decodes -> sampling -> deltas
out and events to listeners. An exception inside a step's forward pass fails
that step's requests and the loop keeps serving; a failure confined to one
request's sampling or detokenizing ends that request alone.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from tokenizers import Tokenizer

from engine.admission import validate_request
from engine.choices import ChoiceGroup
from engine.config import EngineConfig
from engine.cpu_threads import run_torch_serially_here
from engine.events import FinishEvent, StepEvent, step_event
from engine.grammar import GrammarCompiler, mask_logits
from engine.kv_cache import num_blocks_for_budget
from engine.loader import load_model
from engine.request import Delta, EngineRequest
from engine.request_state import RequestState
from engine.runner import ModelRunner
from engine.sampler import sample
from engine.step_timer import StepTimer
from engine.stream import BlockingCollector, RequestStream
from engine.tokenizer import TextTokenizer

from scheduler import Scheduler
from scheduler.config import SchedulerConfig, TierLoad
from scheduler.plan import StepPlan

log = logging.getLogger(__name__)

Listener = Callable[[StepEvent | FinishEvent], None]


class EngineError(RuntimeError):
    pass


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dtype = config.torch_dtype()
        run_torch_serially_here()  # only the engine thread runs torch on several (engine/cpu_threads.py)
        loaded = load_model(config.model, config.device, self.dtype, config.cache_dir, seed=config.seed)
        self.model_name: str = loaded.name
        self.model_config = loaded.model_config
        self.tokenizer = TextTokenizer(
            tokenizer=loaded.tokenizer,
            chat_template=loaded.chat_template,
            bos_token=_token_text(loaded.tokenizer, loaded.bos_token_id),
            eos_token=_token_text(loaded.tokenizer, loaded.eos_token_ids[0] if loaded.eos_token_ids else None),
            eos_token_ids=tuple(loaded.eos_token_ids),
        )
        self.max_model_len = min(config.max_model_len, loaded.model_config.max_position_embeddings)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            loaded.model_config, config.block_size, self.dtype, int(config.kv_cache_memory_gb * 2**30)
        )
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, config.device, self.dtype)
        self.num_kv_blocks = num_blocks
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model_config.vocab_size, tuple(loaded.eos_token_ids))
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.num_kv_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_loras=config.max_loras,
                enable_prefix_caching=config.enable_prefix_caching,
                prefix_cache_scope=config.prefix_cache_scope,
                policy=config.policy,
                fair_share=config.fair_share,
                tiers=config.tiers,
                standard_min_share=config.standard_min_share,
            )
        )
        # Static per tier, computed once so admission need not touch the scheduler's state.
        self._tier_capacity = {t.name: self.scheduler.max_sequence_tokens(t.name) for t in config.tiers}
        self.lora_pool = self._make_lora_pool(config)
        self._timer = StepTimer(config.device)
        self._listeners: list[Listener] = []
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._states: dict[str, RequestState] = {}  # by sequence id; engine thread only
        self._groups: dict[str, ChoiceGroup] = {}  # n > 1 requests by request id; engine thread only
        self._adapter_loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="adapter-load", initializer=run_torch_serially_here)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._load_snapshot: dict[str, TierLoad] = self.scheduler.load()
        self._kv_snapshot: dict[str, int] = {}
        self._spread_snapshot: dict[str, float] = {}
        self._adapter_snapshot: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self.busy_seconds = 0.0  # sum of step durations, for metering checks

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._adapter_loader.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- front -----------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def submit(self, request: EngineRequest) -> RequestStream:
        """Validate and queue a request; iterate the stream for its deltas (needs a running event loop)."""
        stream = RequestStream(request.request_id, self.abort)
        self._admit(request, stream.push)
        return stream

    async def generate(self, request: EngineRequest):
        stream = self.submit(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def generate_batch_sync(self, requests: Iterable[EngineRequest]) -> list[tuple[str, list[int]]]:
        """Run requests concurrently and block until all finish: (text, token ids) for each."""
        collectors = []
        for request in requests:
            collector = BlockingCollector()
            self._admit(request, collector.push)
            collectors.append(collector)
        results = []
        for collector in collectors:
            text, ids = "", []
            for delta in collector:
                if delta.error:
                    raise EngineError(delta.error)
                text += delta.text
                ids.extend(delta.token_ids)
            results.append((text, ids))
        return results

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def load(self) -> dict[str, TierLoad]:
        return self._load_snapshot

    def kv_usage(self) -> tuple[dict[str, int], int]:
        return dict(self._kv_snapshot), self.num_kv_blocks

    def fair_share_spread(self) -> dict[str, float]:
        """Per tier: max minus min virtual token counter over tenants with requests waiting."""
        return self._spread_snapshot

    def adapter_usage(self) -> tuple[frozenset[str], frozenset[str]]:
        """LoRA adapters of running requests and of waiting ones, as of the last step."""
        return self._adapter_snapshot

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- adapters --------------------------------------------------------
    def register_adapter(self, name: str, path: str) -> None:
        self._require_lora().register(name, path)

    def unregister_adapter(self, name: str, timeout: float = 30.0) -> None:
        """Unload an adapter; requests still using it end with an error first (on the engine thread)."""
        pool = self._require_lora()
        if not self.is_running:
            pool.unregister(name)
            return
        done: Future[None] = Future()
        self._inbox.put(("unregister", (name, done)))
        self._wakeup.set()
        done.result(timeout)

    def list_adapters(self) -> list[str]:
        return self.lora_pool.list() if self.lora_pool is not None else []

    def _require_lora(self):
        if self.lora_pool is None:
            raise EngineError("LoRA serving is off (max_loras=0)")
        return self.lora_pool

    def _make_lora_pool(self, config: EngineConfig):
        if config.max_loras <= 0:
            return None
        from lora_pool import BaseShapes, LoraPool

        return LoraPool(
            BaseShapes.from_model_config(self.model_config),
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank,
            device=config.device,
            dtype=self.dtype,
        )

    # ---- admission -------------------------------------------------------
    def _admit(self, request: EngineRequest, sink: Callable[[Delta], None]) -> None:
        validate_request(
            request, self.max_model_len, self._tier_capacity, self.model_config.vocab_size, self.list_adapters()
        )
        # A grammar is compiled on the caller's thread unless cached (the gateway compiles it off its loop first).
        states = [RequestState.create(request, sink, i, self.tokenizer, self.grammars) for i in range(request.params.n)]
        state = states[0]
        if len(states) > 1:
            ChoiceGroup.link(states)
        if request.adapter is None:
            self._enqueue(state)
        else:
            # A cold adapter is read from disk off the step loop; the sequence
            # reaches the scheduler only once its weights are in host memory.
            future = self._adapter_loader.submit(self.lora_pool.prefetch, request.adapter)
            future.add_done_callback(lambda f: self._enqueue(state, f.exception()))

    def _enqueue(self, state: RequestState, error: BaseException | None = None) -> None:
        self._inbox.put(("add", (state, error)))
        self._wakeup.set()

    # ---- the loop --------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping.is_set():
            try:
                changed = self._drain_inbox()
                plan = self.scheduler.schedule()
                if plan.is_empty:
                    if changed:  # else the last step or finish already published this state
                        self._publish_snapshots()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._run_step(plan)
            except Exception:  # a bug outside the forward pass: fail what is in flight, keep serving
                log.exception("engine loop iteration failed")
                for request_id in list(self._states):
                    self._end_request(request_id, status="error", finish_reason="error", error="internal engine error")
        self._drain_inbox()
        for request_id in list(self._states):
            self._end_request(request_id, status="cancelled", finish_reason="abort")

    def _drain_inbox(self) -> bool:
        """Take in what callers sent; whether there was anything."""
        changed = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if kind == "add":
                state, error = payload
                if error is not None:
                    self._refuse(state, str(error))
                    continue
                adapter = state.request.adapter
                if adapter is not None and adapter not in self.lora_pool.list():
                    self._refuse(state, f"adapter {adapter!r} was unloaded")
                    continue
                if state.request_id in self._states or state.request_id in self._groups:
                    self._refuse(state, f"request id {state.request_id!r} is already in flight")
                    continue
                try:
                    self.scheduler.add(state.seq)
                except ValueError as exc:  # checked at admission too; never let it take the loop down
                    self._refuse(state, str(exc))
                    continue
                self._states[state.seq.seq_id] = state
                if state.group is not None:
                    self._groups[state.request_id] = state.group
            elif kind == "abort" and payload in self._groups:
                for sibling in self._groups[payload].states:  # the first to end ends the group
                    self._end_request(sibling.seq.seq_id, status="cancelled", finish_reason="abort")
            elif kind == "abort" and payload in self._states:
                self._end_request(payload, status="cancelled", finish_reason="abort")
            elif kind == "unregister":
                self._unregister_on_loop(*payload)

    def _refuse(self, state: RequestState, error: str) -> None:
        """End a request that never reached the scheduler."""
        self._emit(state.group.finish_event("error") if state.group else state.finish_event("error", "error"))
        usage = state.group.usage() if state.group else state.usage()
        state.sink(Delta(text="", finish_reason="error", usage=usage, error=error))

    def _unregister_on_loop(self, name: str, done: Future) -> None:
        users = [rid for rid, state in self._states.items() if state.request.adapter == name]
        for request_id in users:
            error = f"adapter {name!r} was unloaded"
            self._end_request(request_id, status="error", finish_reason="error", error=error)
        try:
            self.lora_pool.unregister(name)
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _run_step(self, plan: StepPlan) -> None:
        sampling = [c for c in plan.chunks if c.samples]
        started_at = time.time()
        self._timer.start()
        try:
            lora_batch = None
            if self.lora_pool is not None:
                lora_batch = self.lora_pool.batch_for([(c.seq.adapter, c.num_tokens) for c in plan.chunks])
            logits = self.runner.execute(plan, lora_batch)
            states = [self._states[c.seq.seq_id] for c in sampling]
            mask_logits(logits, [s.grammar for s in states])
            sampled = sample(logits, [s.request.params for s in states], [s.generator for s in states])
        except Exception as exc:  # a bad step must not take the loop down
            log.exception("engine step failed")
            self._account_step(plan, started_at, self._timer.stop())
            for chunk in plan.chunks:
                self._end_request(chunk.seq.seq_id, status="error", finish_reason="error", error=str(exc))
            return
        duration = self._timer.stop()
        # The step is accounted before any request of it ends, so billing sees its share of the
        # step before its finish event.
        self._account_step(plan, started_at, duration)

        # Deltas go out after all of the step's bookkeeping: a caller woken by one needs the GIL,
        # which this thread would otherwise hold through that bookkeeping.
        outgoing: list[tuple[Callable[[Delta], None], Delta]] = []
        produced = []
        for chunk, token in zip(sampling, sampled):
            if token.error is None:
                produced.append((chunk, token))
            else:  # ended before the update, which then skips the sequence it no longer knows
                log.error("request %s: %s", chunk.seq.seq_id, token.error)
                self._end_request(chunk.seq.seq_id, "error", "error", error=token.error, outgoing=outgoing)
        self.scheduler.update(plan, {c.seq.seq_id: s.token_id for c, s in produced})

        for chunk, token in produced:
            state = self._states.get(chunk.seq.seq_id)
            if state is None:  # a sibling choice failed earlier in this step and took it along
                continue
            if state.group is not None and state.group.waiting:
                self._release_siblings(state.group)
            if state.grammar is not None and not state.grammar.accept(token.token_id):
                error = "the sampled token is outside the request's grammar"
                self._end_request(chunk.seq.seq_id, "error", "error", error=error, outgoing=outgoing)
                continue
            try:
                delta = state.on_token(token, self.tokenizer, self.max_model_len)
            except Exception as exc:  # e.g. the detokenizer: this request's failure, not its batch's
                log.exception("request %s: building its output failed", state.request_id)
                self._end_request(chunk.seq.seq_id, "error", "error", error=f"detokenizing failed: {exc}",
                                  outgoing=outgoing)
                continue
            if delta.finish_reason is None:
                outgoing.append((state.sink, delta))
            else:
                self._end_request(chunk.seq.seq_id, "ok", delta.finish_reason, last_delta=delta, outgoing=outgoing)
        self._publish_snapshots()
        for sink, delta in outgoing:
            sink(delta)

    def _account_step(self, plan: StepPlan, started_at: float, duration: float) -> None:
        self.busy_seconds += duration
        prefill_tokens = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
        self.scheduler.observe_step(duration, plan.num_tokens, prefill_tokens)
        self._emit(step_event(plan, started_at, duration, self._request_id_of))

    def _request_id_of(self, seq_id: str) -> str:
        state = self._states.get(seq_id)
        return state.request_id if state is not None else seq_id

    def _release_siblings(self, group: ChoiceGroup) -> None:
        """The first choice's prompt is computed and cached: its siblings can share it now."""
        for sibling in group.waiting:
            self.scheduler.add(sibling.seq)
            self._states[sibling.seq.seq_id] = sibling
        group.waiting.clear()

    def _end_request(
        self,
        seq_id: str,
        status: str,
        finish_reason: str,
        last_delta: Delta | None = None,
        error: str | None = None,
        outgoing: list[tuple[Callable[[Delta], None], Delta]] | None = None,
    ) -> None:
        """Finish a request: free its blocks, emit its finish event, then its last delta.

        With `outgoing` (a step's), the delta is appended there and the caller publishes and
        sends; otherwise both happen here.
        """
        state = self._states.pop(seq_id, None)
        if state is None:
            return
        if status == "ok":
            self.scheduler.finish(seq_id)
        else:
            self.scheduler.abort(seq_id)
        last = last_delta or Delta(text="", finish_reason=finish_reason, usage=state.usage(), error=error,
                                   index=state.index)
        # The finish event goes out before the last delta, so the ledger row
        # can be complete by the time the caller sees the end of its stream.
        if state.group is None:
            self._emit(state.finish_event(status, finish_reason))
        else:
            last = self._end_choice(state, status, last)
        if outgoing is not None:
            outgoing.append((state.sink, last))
            return
        self._publish_snapshots()
        state.sink(last)

    def _end_choice(self, state: RequestState, status: str, last: Delta) -> Delta:
        """One choice of an n > 1 request ended; the request's usage and finish event come with its last."""
        group = state.group
        for seq_id in group.end_choice(state.index, status, last.finish_reason):
            if self._states.pop(seq_id, None) is not None:
                self.scheduler.abort(seq_id)
        if group.unfinished:
            return dataclasses.replace(last, usage=None)
        self._groups.pop(group.request_id, None)
        self._emit(group.finish_event(status))
        return dataclasses.replace(last, usage=group.usage())

    def _publish_snapshots(self) -> None:
        self._load_snapshot = self.scheduler.load()
        self._kv_snapshot, _ = self.scheduler.kv_usage()
        self._spread_snapshot = self.scheduler.counter_spread()
        self._adapter_snapshot = self.scheduler.adapter_usage()

    def _emit(self, event: StepEvent | FinishEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("engine event listener failed")


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return tokenizer.id_to_token(token_id) if token_id is not None else None
