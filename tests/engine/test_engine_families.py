"""The whole engine on every served family: chunked prefills, prefix-cache hits and preemption with
recompute give HF transformers' greedy tokens (eager attention), prompts longer than the windows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, StepEvent
from engine.request import EngineRequest, SamplingParams

FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "granite", "smollm3", "olmo2", "olmo3", "exaone4", "ministral", "seed_oss"]
MAX_TOKENS = 10


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", FAMILIES)
def test_chunked_prefix_cached_and_preempted_requests_give_hf_greedy_tokens(kind, tiny_model_dirs, engine_cache_dir):
    model_dir: Path = tiny_model_dirs[kind]
    rng = random.Random(kind)
    shared = [rng.randrange(5, 300) for _ in range(12)]  # three blocks of 4 tokens
    prompts = [shared + [rng.randrange(5, 300) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    prompts += [[rng.randrange(5, 300) for _ in range(rng.randrange(16, 26))] for _ in range(4)]
    # 20 blocks of 4 tokens cannot hold seven sequences of up to 35 tokens; 16-token budgets chunk the prompts.
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=20, max_num_seqs=8,
                          max_num_batched_tokens=16, policy="fcfs", max_loras=0, cache_dir=str(engine_cache_dir))
    events: list = []
    with Engine(config) as engine:
        engine.add_listener(events.append)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        # The first request alone, so that the shared prefix is cached when the rest arrive.
        outputs = engine.generate_batch_sync([EngineRequest("warm", prompts[0], params)])
        outputs += engine.generate_batch_sync([EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts[1:])])
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for i, (prompt, (_, ids)) in enumerate(zip(prompts, outputs)):
        assert ids == hf_greedy(reference, prompt), f"{kind} request {i}"
    finishes = [e for e in events if isinstance(e, FinishEvent)]
    preempted = [p for e in events if isinstance(e, StepEvent) for p in e.preempted]
    assert preempted, "no preemption: the pool is too large for the test"
    assert sum(f.cached_tokens for f in finishes) >= 16, "no prefix-cache hit"
