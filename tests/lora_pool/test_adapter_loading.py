"""Reading peft adapters: what is served, and every refusal naming its problem."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.lora_pool.conftest import ALL_TARGETS
from safetensors.torch import load_file, save_file

from lora_pool import AdapterError, LoraPool
from lora_pool.adapter import inspect_adapter, load_adapter


def test_reads_rank_targets_and_alpha_over_r_scale(adapter_dir, shapes):
    spec = inspect_adapter("a", adapter_dir("a", r=4, lora_alpha=12, target_modules=["q_proj", "down_proj"]),
                           shapes, max_rank=8)
    assert (spec.rank, spec.scale, spec.targets) == (4, 3.0, {"q", "down"})
    assert set(spec.modules) == {(layer, proj) for layer in range(2) for proj in ("q", "down")}


def test_rslora_scales_by_alpha_over_sqrt_r(adapter_dir, shapes):
    spec = inspect_adapter("a", adapter_dir("a", r=4, lora_alpha=8, use_rslora=True), shapes, max_rank=8)
    assert spec.scale == pytest.approx(8 / math.sqrt(4))


def test_loaded_weights_match_the_file_zero_padded_over_untouched_layers(adapter_dir, shapes):
    path = adapter_dir("a", r=2, target_modules=["k_proj"], layers_to_transform=[1])
    weights = load_adapter(inspect_adapter("a", path, shapes, max_rank=8), shapes, torch.float32)
    raw = load_file(path / "adapter_model.safetensors")
    assert list(weights.a) == ["k"]
    assert weights.a["k"].shape == (2, 2, 64) and weights.b["k"].shape == (2, 32, 2)
    assert torch.equal(weights.a["k"][0], torch.zeros(2, 64))
    assert torch.equal(weights.a["k"][1], raw["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"])
    assert torch.equal(weights.b["k"][1], raw["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"])


def test_alpha_pattern_is_folded_into_b_relative_to_the_adapter_scale(adapter_dir, shapes):
    path = adapter_dir("a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 16})
    spec = inspect_adapter("a", path, shapes, max_rank=8)
    weights = load_adapter(spec, shapes, torch.float32)
    raw = load_file(path / "adapter_model.safetensors")
    assert spec.scale == 2.0 and spec.modules[(0, "v")] == (4, 4.0)
    v_b = raw["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    torch.testing.assert_close(weights.b["v"][0], v_b * 2)


def _rewrite_weights(edit):
    def damage(path):
        file = path / "adapter_model.safetensors"
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file)
    return damage


def _edit_config(**changes):
    def damage(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return damage


def _write(file: str, content: str):
    return lambda path: (path / file).write_text(content)


# case -> (peft LoraConfig/model overrides, damage done to the saved directory, expected message)
REFUSALS = {
    "dora": ({"use_dora": True}, None, "DoRA"),
    "bias": ({"bias": "lora_only"}, None, "bias='lora_only'"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "embedding_target": ({"target_modules": ["q_proj", "embed_tokens"]}, None, "['embed_tokens'] are not served"),
    "lm_head_by_pattern": ({"target_modules": r".*(q_proj|lm_head)"}, None, "lm_head"),
    "rank_over_max": ({"r": 16}, None, "rank 16 exceeds max_lora_rank 8"),
    "hidden_size": ({"model_overrides": {"hidden_size": 32}}, None, "different base shape"),
    "layer_count": ({"model_overrides": {"num_hidden_layers": 3}}, None, "layer 2 but the base model has 2"),
    "not_lora": ({}, _edit_config(peft_type="IA3"), "only LORA"),
    "variant": ({}, _edit_config(use_qalora=True), "use_qalora"),
    "missing_config": ({}, lambda path: (path / "adapter_config.json").unlink(), "no adapter_config.json"),
    "bin_weights_only": ({}, lambda path: (path / "adapter_model.safetensors").rename(path / "adapter_model.bin"),
                         "no adapter_model.safetensors (only safetensors"),
    "unpaired": ({}, _rewrite_weights(lambda t: t.pop("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")),
                 "v_proj has lora_A but no lora_B"),
    "int_weights": ({}, _rewrite_weights(lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})),
                    "only float weights"),
    "damaged_file": ({}, _write("adapter_model.safetensors", "not a safetensors file"),
                     "not a readable safetensors file"),
    "config_not_json": ({}, _write("adapter_config.json", "{"), "not readable JSON"),
}


@pytest.fixture
def pool_with_good_adapter(adapter_dir, shapes):
    pool = LoraPool(shapes, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    pool.register("good", adapter_dir("good"))
    return pool


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refuses_what_it_cannot_serve_naming_the_problem(case, adapter_dir, pool_with_good_adapter):
    config, damage, message = REFUSALS[case]
    path = adapter_dir(case, **config)
    if damage:
        damage(path)
    with pytest.raises(AdapterError) as refused:
        pool_with_good_adapter.register(case, path)
    assert message in str(refused.value)
    assert pool_with_good_adapter.list() == ["good"]  # nothing half-registered, the rest untouched
    assert pool_with_good_adapter.batch_for([("good", 1)]) is not None


def test_refuses_a_directory_that_does_not_exist(pool_with_good_adapter, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        pool_with_good_adapter.register("x", tmp_path / "nowhere")
    assert pool_with_good_adapter.list() == ["good"]


def test_a_file_damaged_after_registration_fails_the_load_and_caches_nothing(adapter_dir, shapes, adapter_ready):
    pool = LoraPool(shapes, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    path = adapter_dir("a")
    pool.register("a", path)
    (path / "adapter_model.safetensors").write_bytes(b"gone")
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        pool.prefetch("a")
    assert not adapter_ready(pool, "a") and pool.resident() == {}
