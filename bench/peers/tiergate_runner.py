"""tiergate's own engine on the throughput workload, plus what its steps reveal.

Requests go through the async `Engine.generate`, at most `concurrency` at a
time (a semaphore: the next request starts as one finishes), so TTFT and TPOT
are timed per request as a client sees them. A listener on the engine thread
records every step (duration, prefill tokens, decode rows, context tokens) for
the step-time cost model, and the KV pool's use after each step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from bench.common.workload import BenchRequest
from bench.peers.timing import RequestTiming, RunResult
from bench.sim.step_cost import StepSample
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, StepEvent
from engine.request import EngineRequest, SamplingParams


@dataclass
class StepRecorder:
    """Listener state; runs on the engine thread, between steps."""

    engine: Engine
    block_size: int
    prompt_lens: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)  # tokens in KV per live request
    steps: list[StepSample] = field(default_factory=list)
    peak_blocks: int = 0
    slot_samples: list[tuple[int, int]] = field(default_factory=list)  # (tokens stored, slots allocated)

    def __call__(self, event: StepEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            self.computed.pop(event.request_id, None)
            return
        for request_id, _tier in event.preempted:
            self.computed[request_id] = 0
        prefill = decodes = context = 0
        for item in event.items:
            before = self.computed.get(item.request_id, 0)
            after = before + item.tokens
            self.computed[item.request_id] = after
            if item.tokens == 1 and before >= self.prompt_lens.get(item.request_id, 0):
                decodes += 1
            else:
                prefill += item.tokens
            context += after
        self.steps.append(StepSample(event.duration_s, prefill, decodes, context))
        used = self.engine.scheduler.num_used_blocks
        self.peak_blocks = max(self.peak_blocks, used)
        if used:
            self.slot_samples.append((sum(self.computed.values()), used * self.block_size))

    def reset(self, prompt_lens: dict[str, int]) -> None:
        self.prompt_lens = prompt_lens
        self.computed.clear()
        self.steps = []
        self.peak_blocks = 0
        self.slot_samples = []

    def kv_summary(self, total_blocks: int) -> dict:
        stored = sum(s for s, _ in self.slot_samples)
        allocated = sum(a for _, a in self.slot_samples)
        return {
            "kv_blocks_total": total_blocks,
            "kv_blocks_peak": self.peak_blocks,
            "kv_peak_use": self.peak_blocks / total_blocks,
            # Allocated-but-empty token slots over allocated slots, averaged over steps.
            "kv_waste": 1 - stored / allocated if allocated else None,
        }


class TiergateRunner:
    name = "tiergate"

    def __init__(self, max_concurrency: int, context_per_seq: int, model: str = "bundled", block_size: int = 16,
                 dtype: str | None = None, max_model_len: int = 2048, kv_cache_dtype: str = "auto") -> None:
        """``dtype``: as ``EngineConfig.dtype`` (None: a GGUF on CPU is served in its own quantization);
        ``max_model_len``: the longest prompt and output a request may have; ``kv_cache_dtype``: as
        ``EngineConfig.kv_cache_dtype``."""
        # The same KV room per sequence as llama.cpp's n_ctx gets, so no run preempts.
        blocks = max_concurrency * -(-context_per_seq // block_size)
        # Every concurrency level replays the same prompts; the prefix cache
        # would serve the later levels' prefills from the earlier ones, which
        # no peer gets, so it is off here.
        self.config = EngineConfig(model=model, policy="fcfs", block_size=block_size, num_kv_blocks=blocks,
                                   max_num_seqs=max_concurrency, enable_prefix_caching=False, dtype=dtype,
                                   max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype)
        self.engine = Engine(self.config).start()
        self.recorder = StepRecorder(self.engine, block_size)
        self.engine.add_listener(self.recorder)
        self.steps: list[StepSample] = []  # of every run, for the cost model
        # Per request index, when each of its tokens reached the client (seconds from the run's start).
        self.token_times: dict[int, list[float]] = {}

    def warm_up(self) -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.engine.generate_batch_sync([EngineRequest("warm-up", [1, 2, 3, 4], params)])

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        recorder = self.recorder
        recorder.reset({f"r{r.index}": r.prompt_len for r in requests})
        wall, timings = asyncio.run(self._drive(requests, concurrency))
        self.steps.extend(recorder.steps)
        extra = {"batching": "continuous (engine)", "steps": len(recorder.steps)}
        extra.update(recorder.kv_summary(self.engine.num_kv_blocks))
        tuner = self.engine.runner.thread_tuner
        if tuner is not None:  # step size (tokens, rounded up to a power of two) -> threads its steps ran on
            extra["threads_chosen"] = {str(size): count for size, count in tuner.choices().items()}
        return RunResult(self.name, concurrency, wall, timings, extra)

    async def _drive(self, requests: list[BenchRequest], concurrency: int) -> tuple[float, list[RequestTiming]]:
        slots = asyncio.Semaphore(concurrency)
        self.token_times = {r.index: [] for r in requests}
        begin = time.perf_counter()

        async def one(r: BenchRequest) -> RequestTiming:
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            async with slots:
                issued = time.perf_counter() - begin
                first = None
                produced = 0
                async for delta in self.engine.generate(EngineRequest(f"r{r.index}", r.prompt_token_ids, params)):
                    if delta.error:
                        raise RuntimeError(f"request {r.index} failed: {delta.error}")
                    if delta.token_ids:
                        produced += len(delta.token_ids)
                        self.token_times[r.index] += [time.perf_counter() - begin] * len(delta.token_ids)
                        if first is None:
                            first = time.perf_counter() - begin
                return RequestTiming(r.index, r.prompt_len, produced, issued, first, time.perf_counter() - begin)

        timings = await asyncio.gather(*(one(r) for r in requests))
        return time.perf_counter() - begin, list(timings)

    def close(self) -> None:
        self.engine.shutdown()
