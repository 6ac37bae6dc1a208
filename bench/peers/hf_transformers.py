"""HF transformers as a user runs it: `generate` on float32 weights.

Concurrency 1 is one `generate` per request. Above 1, requests go in static
batches of the concurrency level, left-padded: a batch runs until its longest
request is done, and each request is credited only with its own tokens. A
stopping criterion that never stops records when each decoding step ended, so
TTFT and TPOT come from the same clock as the other runners.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from bench.common.workload import BenchRequest
from bench.peers.timing import RequestTiming, RunResult


class _StepClock(StoppingCriteria):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFTransformersRunner:
    name = "hf-transformers"

    def __init__(self, model_dir: Path, threads: int) -> None:
        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def _generate(self, batch: list[BenchRequest]) -> tuple[float, list[float]]:
        padded = self.tokenizer.pad({"input_ids": [r.prompt_token_ids for r in batch]}, return_tensors="pt")
        longest = max(r.output_len for r in batch)
        clock = _StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                **padded,
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,  # ignore EOS, so every request gets its exact length
                pad_token_id=self.tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        return start, clock.stamps

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        timings = []
        begin = time.perf_counter()
        for first in range(0, len(requests), concurrency):
            batch = requests[first : first + concurrency]
            start, stamps = self._generate(batch)
            for r in batch:
                timings.append(
                    RequestTiming(r.index, r.prompt_len, r.output_len, start - begin,
                                  stamps[0] - begin, stamps[r.output_len - 1] - begin)
                )
        return RunResult(self.name, concurrency, time.perf_counter() - begin, timings,
                         {"batching": "static, left-padded" if concurrency > 1 else "single stream"})

    def warm_up(self) -> None:
        self._generate([BenchRequest(-1, [1, 2, 3, 4], 2)])
