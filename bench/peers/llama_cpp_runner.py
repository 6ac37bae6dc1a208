"""llama.cpp through llama-cpp-python's low-level API, greedy, exact output lengths.

This drives llama.cpp's own batch interface the way llama-server's parallel
slots do, at every concurrency (1 included: no Python sampling or logits copies
of the high-level `Llama` object in the way): one sequence id and KV stream per
slot, every step one `llama_decode` over the running slots' next tokens plus
prompt chunks of newly joined requests, in ascending sequence id order, and a
request joins as soon as a slot frees, taking the lowest free id (continuous
batching of the fixed workload). bench/peers/llama_cpp_check.py times the same
decode shapes alone, as llama.cpp's batched-bench does, to check these runs
against.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from bench.common.workload import BenchRequest
from bench.peers.timing import RequestTiming, RunResult

BATCH_TOKENS = 512  # tokens per llama_decode call (llama.cpp's default n_ubatch)


def _context_per_sequence(requests: list[BenchRequest]) -> int:
    longest = max(r.prompt_len + r.output_len for r in requests)
    return -(-longest // 256) * 256


# The KV cache's formats a run may ask for: "auto" is llama.cpp's default (F16).
KV_TYPES = {"auto": None, "q8_0": llama_cpp.GGML_TYPE_Q8_0}


def context_params(n_seq: int, context_per_sequence: int, n_threads: int,
                   kv_cache_dtype: str = "auto") -> llama_cpp.llama_context_params:
    """The context the batched runs use: one KV stream per sequence, llama.cpp's default batch sizes,
    its keys and values in ``kv_cache_dtype`` (its --cache-type-k/-v)."""
    params = llama_cpp.llama_context_default_params()
    if KV_TYPES[kv_cache_dtype] is not None:
        params.type_k = params.type_v = KV_TYPES[kv_cache_dtype]
    params.n_seq_max = n_seq
    params.n_ctx = n_seq * (-(-context_per_sequence // 256) * 256)
    params.n_batch = BATCH_TOKENS
    params.n_ubatch = BATCH_TOKENS
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.kv_unified = False  # llama.cpp's advice for unrelated sequences
    return params


class ThreadPicker:
    """llama.cpp's thread count per step size, picked by timing steps, as tiergate's own tuner does
    (engine/cpu_threads.py): on cores shared with other processes one OpenMP thread can run a
    step several times faster than two, and a peer with a count fixed ahead would run below itself.

    Steps of one size class (tokens rounded up to a power of two) alternate between the candidates
    for ``trial_steps`` steps each, the fastest per token is kept, and the trial is repeated every
    ``period`` steps of that size.
    """

    def __init__(self, ctx, max_threads: int, trial_steps: int = 3, period: int = 200, pinned: bool = False) -> None:
        self.ctx = ctx
        self.candidates = [max_threads] if pinned else sorted({1, max_threads})
        self.trial_steps, self.period = trial_steps, period
        self.by_size: dict[int, dict] = {}
        self.current = max_threads
        self._step: tuple[dict, int] | None = None

    def before_step(self, num_tokens: int) -> None:
        size = 1 << max(num_tokens - 1, 0).bit_length()
        state = self.by_size.setdefault(size, {"chosen": self.candidates[-1], "schedule": [], "samples": {}, "left": 0})
        if not state["schedule"] and state["left"] <= 0 and len(self.candidates) > 1:
            state["schedule"] = [c for _ in range(self.trial_steps) for c in self.candidates]
            state["samples"] = {c: [] for c in self.candidates}
            state["left"] = self.period
        count = state["schedule"].pop(0) if state["schedule"] else state["chosen"]
        state["left"] -= 1
        if count != self.current:
            llama_cpp.llama_set_n_threads(self.ctx, count, count)
            self.current = count
        self._step = (state, count)

    def after_step(self, seconds: float) -> None:
        state, count = self._step
        if count in state["samples"]:
            state["samples"][count].append(seconds)
            if not state["schedule"]:
                state["chosen"] = min(state["samples"], key=lambda c: statistics.median(state["samples"][c]))
                state["samples"] = {}

    def choices(self) -> dict[str, int]:
        return {str(size): state["chosen"] for size, state in sorted(self.by_size.items())}


@dataclass
class _Slot:
    seq_id: int
    request: BenchRequest
    issued_s: float
    fed: int = 0  # prompt tokens already decoded
    generated: int = 0
    last_token: int = 0
    first_token_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.fed < self.request.prompt_len

    @property
    def position(self) -> int:
        return self.request.prompt_len + self.generated - 1


class LlamaCppRunner:
    def __init__(self, model_path: Path, label: str, n_threads: int, pin_threads: bool = False,
                 kv_cache_dtype: str = "auto") -> None:
        self.name = f"llama.cpp-{label}"
        self.kv_cache_dtype = kv_cache_dtype
        self.model_path = model_path
        self.n_threads = n_threads
        self.pin_threads = pin_threads  # every step on n_threads, as llama-bench runs, instead of picking
        # Per request index, when each of its tokens was sampled (seconds from the run's start).
        self.token_times: dict[int, list[float]] = {}

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        return self._run_batched(requests, concurrency)

    def warm_up(self) -> None:
        self._run_batched([BenchRequest(-1, [1, 2, 3, 4], 2)], 2)

    def _run_batched(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        model_params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(self.model_path).encode(), model_params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.model_path}")
        params = context_params(concurrency, _context_per_sequence(requests), self.n_threads, self.kv_cache_dtype)
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise RuntimeError("llama.cpp could not create a context")
        batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
        sampler = llama_cpp.llama_sampler_init_greedy()
        try:
            return self._continuous_batching(ctx, batch, sampler, requests, concurrency)
        finally:
            llama_cpp.llama_sampler_free(sampler)
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)

    def _continuous_batching(self, ctx, batch, sampler, requests, concurrency) -> RunResult:
        memory = llama_cpp.llama_get_memory(ctx)
        pending = deque(requests)
        free_ids = list(range(concurrency))  # a heap: the lowest free id first
        running: list[_Slot] = []
        timings: list[RequestTiming] = []
        steps = 0
        full_decode_steps: list[float] = []
        threads = ThreadPicker(ctx, self.n_threads, pinned=self.pin_threads)
        self.token_times = {r.index: [] for r in requests}
        begin = time.perf_counter()
        while pending or running:
            while pending and free_ids:
                seq_id = heapq.heappop(free_ids)
                llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
                running.append(_Slot(seq_id, pending.popleft(), time.perf_counter() - begin))

            n = 0
            sampled: list[tuple[int, _Slot]] = []

            def add(token: int, pos: int, seq_id: int, wants_logits: bool) -> None:
                nonlocal n
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = wants_logits
                n += 1

            # Decodes first, then prompt chunks in the room left, as llama-server does, and in
            # ascending sequence id order, as its slots are visited: with a KV stream per
            # sequence llama.cpp cuts a batch into one micro-batch per run of consecutive ids
            # (split_equal, sequential), so any other order runs each decode token on its own.
            running.sort(key=lambda slot: slot.seq_id)
            for slot in running:
                if not slot.prefilling:
                    sampled.append((n, slot))
                    add(slot.last_token, slot.position, slot.seq_id, True)
            for slot in running:
                if slot.prefilling and n < BATCH_TOKENS:
                    chunk = min(slot.request.prompt_len - slot.fed, BATCH_TOKENS - n)
                    for k in range(chunk):
                        pos = slot.fed + k
                        last = pos == slot.request.prompt_len - 1
                        if last:
                            sampled.append((n, slot))
                        add(slot.request.prompt_token_ids[pos], pos, slot.seq_id, last)
                    slot.fed += chunk
            batch.n_tokens = n
            threads.before_step(n)
            decode_started = time.perf_counter()
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            decode_s = time.perf_counter() - decode_started
            threads.after_step(decode_s)
            if n == concurrency == len(sampled):  # every slot decoding one token: the check's shape
                full_decode_steps.append(decode_s)
            steps += 1
            now = time.perf_counter() - begin

            for row, slot in sampled:
                slot.last_token = llama_cpp.llama_sampler_sample(sampler, ctx, row)
                slot.generated += 1
                self.token_times[slot.request.index].append(now)
                if slot.generated == 1:
                    slot.first_token_s = now
                if slot.generated == slot.request.output_len:
                    r = slot.request
                    timings.append(RequestTiming(r.index, r.prompt_len, slot.generated,
                                                 slot.issued_s, slot.first_token_s, now))
                    running.remove(slot)
                    heapq.heappush(free_ids, slot.seq_id)
        wall = time.perf_counter() - begin
        extra = {"batching": "llama_decode, one sequence per slot, ascending ids", "steps": steps,
                 "full_decode_steps": len(full_decode_steps),
                 "full_decode_step_ms_p50": statistics.median(full_decode_steps) * 1e3 if full_decode_steps else None,
                 "threads_chosen": threads.choices()}
        return RunResult(self.name, concurrency, wall, sorted(timings, key=lambda t: t.index), extra)
