"""The bfloat16 opt-in (`tiergate serve --dtype bfloat16`): served only on CPUs with native bf16,
through the same panel kernel as float32, close to float32's answers; float32 stays the default."""

from __future__ import annotations

import pytest
import torch

import engine.config as engine_config
from engine.config import EngineConfig
from engine.engine import Engine
from engine.packed_linear import PanelWeight, weight_form
from engine.request import EngineRequest, SamplingParams


def test_float32_is_the_default_on_cpu_and_float16_is_refused():
    assert EngineConfig().torch_dtype() == torch.float32
    with pytest.raises(ValueError, match="float16 is not served on CPU"):
        EngineConfig(dtype="float16").torch_dtype()


def test_bfloat16_is_refused_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with native bf16"):
        EngineConfig(dtype="bfloat16").torch_dtype()
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)
    assert EngineConfig(dtype="bfloat16").torch_dtype() == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 7, 30])
def test_the_panel_kernel_multiplies_bfloat16_weights_with_float32_sums(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 50, generator=gen) * 0.1).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    packed = PanelWeight(weight)
    y = packed(x)
    expected = x.double() @ weight.double()
    assert y.dtype == torch.bfloat16 and torch.equal(packed.dense(), weight)
    # Sums in float32, one rounding to bfloat16 at the end: within half a bfloat16 ulp (2**-8 relative).
    assert ((y.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()
    assert weight_form("cpu", torch.bfloat16) == "panels"


def test_a_bfloat16_engine_answers_like_float32_and_frees_its_blocks(tiny_model_dirs, monkeypatch):
    # The kernels' bf16 path is plain integer shifts, so it runs on any CPU; only the refusal reads the flags.
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)
    prompts = [[5 + i, 17, 33, 9 + i, 60] for i in range(4)]
    answers = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(model=str(tiny_model_dirs["gqa_untied"]), dtype=dtype, num_kv_blocks=64, block_size=4,
                              max_loras=0)
        with Engine(config) as engine:
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            results = engine.generate_batch_sync([EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
            answers[dtype] = [ids for _, ids in results]
            assert engine.scheduler.num_used_blocks == 0
    first_tokens_agree = sum(a[0] == b[0] for a, b in zip(answers["float32"], answers["bfloat16"]))
    assert first_tokens_agree >= 3, answers
