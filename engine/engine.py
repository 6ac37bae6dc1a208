"""The engine's front: built from an EngineConfig, used from any thread.

Callers submit requests and aborts, register adapters and read the engine's load; all of it
reaches the engine thread (engine/step_loop.py) through its inbox (engine/inbox.py), and what
they read back is the snapshot that thread last published.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from tokenizers import Tokenizer

from engine.choices import ChoiceGroup
from engine.config import EngineConfig
from engine.draft_model import DraftModel, check_same_vocabulary
from engine.cpu_threads import run_torch_serially_here
from engine.events import Listener
from engine.grammar_compiler import Compiled, GrammarCompiler
from engine.inbox import AbortRequest, AddRequest, Inbox, UnregisterAdapter
from engine.kv_cache import pool_blocks
from engine.loader import LoadedModel, load_model
from engine.request import Delta, EngineRequest
from engine.request_state import RequestState
from engine.runner import ModelRunner
from engine.speculative import SpeculativeConfig, Speculator
from engine.step_calibration import Calibration
from engine.step_loop import StepLoop
from engine.step_timer import StepTimer
from engine.stream import BlockingCollector, RequestStream
from engine.tokenizer import TextTokenizer
from engine.validation import RequestLimits
from scheduler import Scheduler, TierLoad


class EngineError(RuntimeError):
    pass


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dtype = config.torch_dtype()
        run_torch_serially_here()  # only the engine thread runs torch on several (engine/cpu_threads.py)
        loaded = load_model(config.model, config.device, self.dtype, config.cache_dir, seed=config.seed,
                            native_gguf=config.native_gguf, quantize=config.quantize)
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
        kv_dtype = config.kv_dtype()
        num_blocks = config.num_kv_blocks or pool_blocks(
            loaded.model_config, config.block_size, kv_dtype, config.device, config.kv_cache_bytes,
            config.kv_cache_tokens, config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, config.device, self.dtype, kv_dtype=kv_dtype)
        self.num_kv_blocks = num_blocks
        drafter = None if config.draft_model is None else self._load_draft_model(config, loaded, num_blocks)
        self.grammars = GrammarCompiler(
            loaded.tokenizer, loaded.model_config.vocab_size, tuple(loaded.eos_token_ids),
            timeout_s=config.grammar_compile_timeout_s, workers=config.grammar_compile_workers,
            cache_bytes=config.grammar_cache_bytes, shared_cache=config.grammar_cache_scope == "shared")
        # A regime no sequence can reach (the context stops short of it) is no regime.
        long_after = loaded.model_config.long_context_after
        if long_after is not None and long_after >= self.max_model_len:
            long_after = None
        self.scheduler = Scheduler(config.scheduler_config(num_blocks, self.max_model_len, long_after))
        # Static per tier, computed once so checking a request need not touch the scheduler's state.
        self.limits = RequestLimits(self.max_model_len,
                                    {t.name: self.scheduler.max_sequence_tokens(t.name) for t in config.tiers},
                                    loaded.model_config.vocab_size)
        self.lora_pool = self._make_lora_pool(config)
        self._inbox = Inbox()
        speculator = None
        if config.speculative is not None:
            speculator = Speculator(SpeculativeConfig(config.speculative, config.num_speculative_tokens,
                                                      adaptive=config.speculative_adaptive),
                                    self.scheduler, self.tokenizer.eos_token_ids, drafter)
        self._loop = StepLoop(self.scheduler, self.runner, self.lora_pool, self.tokenizer, self.max_model_len,
                              StepTimer(config.device), self._inbox, config.express_steps_on,
                              grammar_mask_budget_s=config.grammar_mask_budget_s, speculator=speculator,
                              calibrate_step_cost=config.calibrate_step_cost)
        if speculator is not None:
            self._loop.requests.on_leave.append(speculator.release)
        self._adapter_loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="adapter-load", initializer=run_torch_serially_here)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _load_draft_model(self, config: EngineConfig, base: LoadedModel, base_blocks: int) -> DraftModel:
        """The draft model, refused unless its tokenizer is the base model's; its KV pool is its own."""
        loaded = load_model(config.draft_model, config.device, self.dtype, config.cache_dir, seed=config.seed,
                            native_gguf=config.native_gguf)
        check_same_vocabulary(base.tokenizer, loaded.tokenizer)
        return DraftModel(loaded, config.draft_num_kv_blocks or base_blocks, config.block_size,
                          base.model_config.vocab_size, config.device, self.dtype)

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread; returns once it serves (its step costs timed first: engine/step_calibration.py)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop.run, args=(self._stopping,), name="engine-loop",
                                            daemon=True)
            self._thread.start()
            while not self._loop.started.wait(0.1) and self._thread.is_alive():
                pass
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._adapter_loader.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- front -----------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """``listener`` gets every StepEvent and FinishEvent, on the engine thread; it must not block."""
        self._loop.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop sending events to ``listener`` (added by ``add_listener``)."""
        self._loop.listeners.remove(listener)

    def submit(self, request: EngineRequest) -> RequestStream:
        """Validate and queue a request; iterate the stream for its deltas (needs a running event loop)."""
        stream = RequestStream(request.request_id, self.abort)
        self._accept_request(request, stream.push)
        return stream

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
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
            self._accept_request(request, collector.push)
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

    def check(self, request: EngineRequest) -> None:
        """InvalidRequest (engine/validation.py) if the engine would refuse ``request``; submit() checks too."""
        self.limits.check(request, self.list_adapters())

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    def load(self) -> dict[str, TierLoad]:
        return self._loop.snapshot.load

    def kv_usage(self) -> tuple[dict[str, int], int]:
        return dict(self._loop.snapshot.kv_used), self.num_kv_blocks

    def fair_share_spread(self) -> dict[str, float]:
        """Per tier: max minus min virtual token counter over tenants with requests waiting."""
        return self._loop.snapshot.spread

    def adapter_usage(self) -> tuple[frozenset[str], frozenset[str]]:
        """LoRA adapters of running requests and of waiting ones, as of the last step."""
        return self._loop.snapshot.adapters

    @property
    def calibration(self) -> Calibration | None:
        """What the engine timed before its first step (engine/step_calibration.py); None until then, or when
        ``EngineConfig.calibrate_step_cost`` is off or the KV pool could not hold the timed steps."""
        return self._loop.calibration

    @property
    def busy_seconds(self) -> float:
        """The sum of step durations so far: what metering must account for, to the last second."""
        return self._loop.busy_seconds

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
        self._inbox.put(UnregisterAdapter(name, done))
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
            stack_dtype=self._lora_stack_dtype(config),
        )

    def _lora_stack_dtype(self, config: EngineConfig) -> torch.dtype:
        """The adapters' weights' dtype: ``config.lora_dtype`` if given (LoraPool refuses what it cannot
        run); else bfloat16 on CPU over quantized projections, whose own rounding is far coarser than
        bfloat16's, where the LoRA kernel reads them at half float32's bytes; else the model's dtype."""
        if config.lora_dtype is not None:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.lora_dtype]
        from lora_pool import ops

        quantized = "quant" in self.runner.model.weight_forms()
        if self.dtype == torch.float32 and quantized and ops.rows_kernel() is not None:
            return torch.bfloat16
        return self.dtype

    # ---- taking a request ------------------------------------------------
    def _accept_request(self, request: EngineRequest, sink: Callable[[Delta], None]) -> None:
        self.check(request)
        states = [RequestState.create(request, sink, i, self.tokenizer) for i in range(request.num_sequences)]
        if len(states) > 1:
            ChoiceGroup.link(states, request.params.n)
        spec = request.params.grammar
        if spec is None:
            self._prepare_adapter(states[0])
        elif request.compiled_grammar is not None:  # the gateway's compile: nothing to compile here
            self._with_grammar(states, Compiled(request.compiled_grammar, 0.0))
        else:
            # Never on the caller's thread (an event loop) nor the engine's: on the compiler's own.
            self.grammars.submit(spec, request.tenant).add_done_callback(lambda f: self._on_compiled(states, f))

    def _on_compiled(self, states: list[RequestState], future: Future[Compiled]) -> None:
        if future.cancelled():  # the engine is stopping
            self._enqueue(states[0], EngineError("the engine stopped before the grammar was compiled"))
        elif future.exception() is not None:
            self._enqueue(states[0], future.exception())
        else:
            self._with_grammar(states, future.result())

    def _with_grammar(self, states: list[RequestState], compiled: Compiled) -> None:
        for state in states:
            state.grammar = self.grammars.matcher(compiled.grammar)
        self._prepare_adapter(states[0])

    def _prepare_adapter(self, state: RequestState) -> None:
        if state.request.adapter is None:
            self._enqueue(state)
        else:
            # A cold adapter is read from disk off the step loop; the sequence
            # reaches the scheduler only once its weights are in host memory.
            future = self._adapter_loader.submit(self.lora_pool.prefetch, state.request.adapter)
            future.add_done_callback(lambda f: self._enqueue(state, f.exception()))

    def _enqueue(self, state: RequestState, error: BaseException | None = None) -> None:
        self._inbox.put(AddRequest(state, error))


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return tokenizer.id_to_token(token_id) if token_id is not None else None
