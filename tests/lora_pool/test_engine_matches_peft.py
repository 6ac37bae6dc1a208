"""The must-show check: the engine serving a batch that mixes four adapters (different ranks
and target sets) with base-only rows gives peft's PeftModel tokens and logits per request.

Two levels: ModelRunner steps (mixed prefill chunks and decodes, logits within 1e-3 of
PeftModel at every sampled position) and the whole Engine (greedy tokens and their
logprobs against PeftModel's greedy generation).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tests.lora_pool.conftest import ALL_TARGETS
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import load_model
from engine.request import EngineRequest, SamplingParams
from engine.runner import ModelRunner
from lora_pool import BaseShapes, LoraPool
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, build_tiny_model, chunk, finish_step

ADAPTERS = {
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all_r16_rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_TARGETS),
    "mlp_r2": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qv_r8_upper_layers": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                               layers_to_transform=[1, 2]),
}
# (adapter or None, prompt) per request; repeats and base rows share the step with the others
REQUESTS = [("attn_r4", 11), (None, 6), ("all_r16_rslora", 9), ("mlp_r2", 14), ("qv_r8_upper_layers", 5),
            ("attn_r4", 7), (None, 12)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base"), "gqa_untied")


def write_adapters(base_dir: Path, make_dir: Callable[[str], Path]) -> dict[str, Path]:
    """Each of ADAPTERS with random A and B, saved in ``make_dir(name)``."""
    dirs = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(init_lora_weights=False, **config))
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn_like(param) * 0.15)
        dirs[name] = make_dir(name)
        model.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory):
    return write_adapters(base_dir, tmp_path_factory.mktemp)


@pytest.fixture(scope="module")
def peft_models(base_dir, adapter_dirs):
    """name (None for the base) -> the reference model for requests on that adapter."""
    models = {None: AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()}
    for name, path in adapter_dirs.items():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(base, path).eval()
    return models


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(5, 300, (length,), generator=gen).tolist() for _, length in REQUESTS]


@torch.no_grad()
def peft_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1].float()


def test_runner_steps_mixing_adapters_and_base_rows_match_peft_logits(base_dir, adapter_dirs, peft_models, linear_path):
    loaded = load_model(str(base_dir))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert runner.model.weight_form == linear_path
    pool = LoraPool(BaseShapes.from_model_config(loaded.model_config), max_loras=4, max_cpu_loras=4,
                    max_lora_rank=16)
    for name, path in adapter_dirs.items():
        pool.register(name, path)
    blocks = BlockPool(64)
    seqs = [Sequence(f"r{i}", ids, adapter=name) for i, ((name, _), ids) in enumerate(zip(REQUESTS, prompts()))]

    def next_chunk(seq: Sequence, cap: int):
        start = seq.num_computed_tokens
        return chunk(seq, start, min(seq.num_tokens - start, cap), blocks, 4)

    # step 0 prefills four requests (one only partly: a chunk that does not sample); step 1
    # mixes their decodes with the rest's prefills; steps 2-3 decode everything.
    for step, active in enumerate([seqs[:4], seqs, seqs, seqs]):
        plan = StepPlan([next_chunk(s, 8 if step == 0 else 64) for s in active])
        lora = pool.batch_for([(c.seq.adapter, c.num_tokens) for c in plan.chunks])
        logits = runner.execute(plan, lora)
        for c, row in zip([c for c in plan.chunks if c.samples], logits):
            expected = peft_last_logits(peft_models[c.seq.adapter], c.seq.all_token_ids[: c.end])
            diff = (row - expected).abs().max().item()
            assert diff < 1e-3, f"{c.seq.seq_id} ({c.seq.adapter}) step {step}: max abs logit diff {diff}"
            assert int(row.argmax()) == int(expected.argmax())
        finish_step(plan, logits)
    assert all(len(s.output_token_ids) >= 2 for s in seqs)
    # the adapters change the model, so the comparison above can fail
    base_logits = peft_last_logits(peft_models[None], seqs[0].all_token_ids[:-1])
    lora_logits = peft_last_logits(peft_models["attn_r4"], seqs[0].all_token_ids[:-1])
    assert (base_logits - lora_logits).abs().max() > 0.1


@torch.no_grad()
def peft_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logp = torch.log_softmax(peft_last_logits(model, ids), dim=-1)
        token = int(logp.argmax())
        ids.append(token)
        logprobs.append(float(logp[token]))
    return ids[len(prompt):], logprobs


def test_engine_batch_of_four_adapters_and_base_rows_gives_peft_greedy_tokens(base_dir, adapter_dirs, peft_models):
    config = EngineConfig(model=str(base_dir), max_loras=4, max_cpu_loras=4, max_lora_rank=16, max_num_seqs=8,
                          num_kv_blocks=128, block_size=4)
    with Engine(config) as engine:
        for name, path in adapter_dirs.items():
            engine.register_adapter(name, str(path))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
        requests = [EngineRequest(f"r{i}", ids, params, adapter=name)
                    for i, ((name, _), ids) in enumerate(zip(REQUESTS, prompts()))]
        streamed = asyncio.run(generate_all(engine, requests))
        synced = engine.generate_batch_sync([EngineRequest(f"again{i}", r.prompt_token_ids, params, adapter=r.adapter)
                                             for i, r in enumerate(requests)])
    for (name, _), prompt, (tokens, logprobs), (_, synced_tokens) in zip(REQUESTS, prompts(), streamed, synced):
        expected_tokens, expected_logprobs = peft_greedy(peft_models[name], prompt, 6)
        assert tokens == expected_tokens == synced_tokens, f"adapter {name}"
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-3, f"adapter {name}"


async def generate_all(engine: Engine, requests: list[EngineRequest]) -> list[tuple[list[int], list[float]]]:
    """All requests at once, so the engine batches them: (token ids, their logprobs) each."""
    async def one(request: EngineRequest) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        async for delta in engine.generate(request):
            assert delta.error is None, delta.error
            tokens.extend(delta.token_ids)
            logprobs.extend(lp.logprob for lp in delta.logprobs)
        return tokens, logprobs

    return await asyncio.gather(*(one(r) for r in requests))


def test_unloading_an_adapter_ends_its_requests_and_the_rest_keep_running(base_dir, adapter_dirs):
    config = EngineConfig(model=str(base_dir), max_loras=4, max_lora_rank=16, num_kv_blocks=256, block_size=4)
    with Engine(config) as engine:
        for name in ("attn_r4", "mlp_r2"):
            engine.register_adapter(name, str(adapter_dirs[name]))
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

        async def run() -> dict[str, str | None]:
            streams = {name: engine.submit(EngineRequest(name, [5, 6, 7], params, adapter=name))
                       for name in ("attn_r4", "mlp_r2")}
            first = await streams["attn_r4"].__anext__()  # the adapter's request is running
            assert first.error is None
            await asyncio.to_thread(engine.unregister_adapter, "attn_r4")
            last_unloaded = [d async for d in streams["attn_r4"]][-1]
            await streams["mlp_r2"].aclose()
            return {"unloaded": last_unloaded.error}

        result = asyncio.run(run())
        assert "was unloaded" in result["unloaded"]
        assert engine.list_adapters() == ["mlp_r2"]
        (_, ids), = engine.generate_batch_sync([EngineRequest("after", [5, 6], SamplingParams(max_tokens=3), adapter="mlp_r2")])
        assert len(ids) == 3
        with pytest.raises(ValueError, match="unknown adapter"):
            engine.generate_batch_sync([EngineRequest("gone", [5, 6], SamplingParams(max_tokens=3), adapter="attn_r4")])
