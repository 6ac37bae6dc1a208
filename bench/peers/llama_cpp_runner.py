"""llama.cpp through llama-cpp-python, greedy, exact output lengths.

Concurrency 1 uses the high-level streaming `Llama.generate`, as a user would.
Above 1 there is no high-level batched API, so this drives llama.cpp's own
batch interface the way llama-server's parallel slots do: one sequence id per
slot, every step one `llama_decode` over the running slots' next tokens plus
prompt chunks of newly joined requests, and a request joins as soon as a slot
frees (continuous batching of the fixed workload).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from bench.peers.timing import RequestTiming, RunResult
from bench.workload import BenchRequest

BATCH_TOKENS = 512  # tokens per llama_decode call (llama.cpp's default n_ubatch)


def _context_per_sequence(requests: list[BenchRequest]) -> int:
    longest = max(r.prompt_len + r.output_len for r in requests)
    return -(-longest // 256) * 256


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
    def __init__(self, model_path: Path, label: str, n_threads: int) -> None:
        self.name = f"llama.cpp-{label}"
        self.model_path = model_path
        self.n_threads = n_threads

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        if concurrency == 1:
            return self._run_single_stream(requests)
        return self._run_batched(requests, concurrency)

    def warm_up(self) -> None:
        warm = [BenchRequest(-1, [1, 2, 3, 4], 2)]
        self._run_single_stream(warm)
        self._run_batched(warm, 2)

    def _run_single_stream(self, requests: list[BenchRequest]) -> RunResult:
        llm = llama_cpp.Llama(
            str(self.model_path), n_ctx=_context_per_sequence(requests), n_batch=BATCH_TOKENS,
            n_threads=self.n_threads, n_threads_batch=self.n_threads, verbose=False,
        )
        timings = []
        begin = time.perf_counter()
        for r in requests:
            issued = time.perf_counter()
            first = 0.0
            produced = 0
            for _ in llm.generate(r.prompt_token_ids, temp=0.0):
                produced += 1
                if produced == 1:
                    first = time.perf_counter()
                if produced == r.output_len:  # ignore EOS: stop only at the request's length
                    break
            timings.append(RequestTiming(r.index, r.prompt_len, produced, issued - begin,
                                         first - begin, time.perf_counter() - begin))
        wall = time.perf_counter() - begin
        llm.close()
        return RunResult(self.name, 1, wall, timings, {"batching": "Llama.generate"})

    def _run_batched(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        model_params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(self.model_path).encode(), model_params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.model_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = concurrency
        params.n_ctx = concurrency * _context_per_sequence(requests)
        params.n_batch = BATCH_TOKENS
        params.n_ubatch = BATCH_TOKENS
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        params.kv_unified = False  # llama.cpp's advice for unrelated sequences
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
        free_ids = list(range(concurrency))
        running: list[_Slot] = []
        timings: list[RequestTiming] = []
        steps = 0
        begin = time.perf_counter()
        while pending or running:
            while pending and free_ids:
                seq_id = free_ids.pop()
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

            # Decodes first, then prompt chunks in the room left, as llama-server does.
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
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            steps += 1
            now = time.perf_counter() - begin

            for row, slot in sampled:
                slot.last_token = llama_cpp.llama_sampler_sample(sampler, ctx, row)
                slot.generated += 1
                if slot.generated == 1:
                    slot.first_token_s = now
                if slot.generated == slot.request.output_len:
                    r = slot.request
                    timings.append(RequestTiming(r.index, r.prompt_len, slot.generated,
                                                 slot.issued_s, slot.first_token_s, now))
                    running.remove(slot)
                    free_ids.append(slot.seq_id)
        wall = time.perf_counter() - begin
        return RunResult(self.name, concurrency, wall, sorted(timings, key=lambda t: t.index),
                         {"batching": "llama_decode, one sequence per slot", "steps": steps})
