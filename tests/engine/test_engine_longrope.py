"""Phi-3's LongRoPE (and Phi-4-mini's partial rotary with it) through the whole engine: each sequence
of a mixed batch gets the greedy tokens and logprobs HF transformers gives it generated alone (eager
attention), whether it stays under the original context, starts past it, or crosses it mid-generation.

HF's Phi-3 switches a sequence to the long factors when it first outgrows
``original_max_position_embeddings`` and then recomputes it whole (``prepare_inputs_for_generation``
drops the cache), so the earlier keys are rotated anew; the engine restarts such a sequence
(scheduler/scheduler.py) and keeps the two regimes' blocks apart in the prefix cache.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, StepEvent
from engine.request import Delta, EngineRequest, SamplingParams

MAX_TOKENS = 12
ORIGINAL = 64  # original_max_position_embeddings of the tiny configs (tests/engine/conftest.py)
TOP = 5


@torch.no_grad()
def hf_alone(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and the log-softmax of each step's raw logits, for ``prompt`` alone."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.logits]


def _run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[Delta]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)

    async def one(request_id: str, prompt: list[int]) -> list[Delta]:
        return [d async for d in engine.generate(EngineRequest(request_id, prompt, params))]

    async def main() -> list[list[Delta]]:
        return await asyncio.gather(*(one(rid, p) for rid, p in prompts.items()))

    return dict(zip(prompts, asyncio.run(main())))


@pytest.mark.parametrize("kind", ["phi3_longrope", "phi4_mini"])
def test_sequences_below_past_and_across_the_original_context_match_hf_alone(kind, tiny_model_dirs,
                                                                              engine_cache_dir):
    model_dir: Path = tiny_model_dirs[kind]
    rng = random.Random(kind)
    tokens = lambda n: [rng.randrange(5, 300) for _ in range(n)]  # noqa: E731
    shared = tokens(40)  # ten blocks of 4
    first = {"long_first": shared + tokens(30)}  # past the original context from the start
    batch = {
        "crossing": shared + tokens(ORIGINAL - 6 - 40),  # 58 tokens: crosses after 7 generated tokens
        "short": tokens(20),  # 32 tokens at most: stays short
        "long_hit": shared + tokens(28),  # long, and hits long_first's blocks
    }
    # 16-token budgets chunk every prompt; enough blocks that nothing is preempted.
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=160, max_num_seqs=8,
                          max_num_batched_tokens=16, max_loras=0, cache_dir=str(engine_cache_dir))
    events: list = []
    with Engine(config) as engine:
        assert engine.scheduler.config.long_context_after == ORIGINAL
        engine.add_listener(events.append)
        outputs = _run(engine, first)
        outputs.update(_run(engine, batch))

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for request_id, prompt in {**first, **batch}.items():
        expected_ids, expected_logprobs = hf_alone(reference, prompt)
        deltas = outputs[request_id]
        assert [t for d in deltas for t in d.token_ids] == expected_ids, f"{kind} {request_id}"
        logprobs = [lp for d in deltas for lp in d.logprobs]
        assert len(logprobs) == MAX_TOKENS
        for i, (lp, hf) in enumerate(zip(logprobs, expected_logprobs)):
            ours = {lp.token_id: lp.logprob} | {tok: val for tok, _, val in lp.top}
            diff = max(abs(val - hf[tok].item()) for tok, val in ours.items())
            assert diff < 1e-3, f"{kind} {request_id} token {i}: logprobs differ by {diff}"

    finishes = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert finishes["long_hit"].cached_tokens == 40, "no prefix hit in the long regime"
    assert finishes["crossing"].cached_tokens == 0, "a short sequence hit blocks computed in the long regime"
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert not any(e.preempted for e in steps)
    recomputed = sum(i.tokens for e in steps for i in e.items if i.request_id == "crossing" and i.is_recompute)
    # The restart recomputes its 64 short-regime positions less the 40 the long regime had cached.
    assert recomputed == ORIGINAL - 40
    # Long and short rows ran in one step.
    assert any({i.request_id for i in e.items} >= {"short", "long_hit"} for e in steps)


@torch.no_grad()
def test_keeping_the_short_regimes_keys_past_the_crossing_would_not_match_hf(tiny_model_dirs):
    """What the restart is for: HF's logits at the crossing differ from those over keys cached short."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["phi3_longrope"], dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ids = torch.tensor([random.Random(0).sample(range(5, 300), ORIGINAL + 1)])
    cached = reference(ids[:, :ORIGINAL], use_cache=True).past_key_values  # the short regime's keys
    over_short_keys = reference(ids[:, ORIGINAL:], past_key_values=cached).logits[0, -1]
    recomputed = reference(ids).logits[0, -1]
    assert (torch.log_softmax(over_short_keys, -1) - torch.log_softmax(recomputed, -1)).abs().max() > 1e-2
