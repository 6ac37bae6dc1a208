"""The committed demo adapters fit the bundled model and stay small."""

from __future__ import annotations

import pytest

from lora_pool import BaseShapes
from lora_pool.adapter import inspect_adapter
from lora_pool.demo_adapters import demo_adapters

# SmolLM2-135M-Instruct: 30 layers, hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64.
BUNDLED = BaseShapes.for_llama(30, 576, 1536, 9, 3, head_dim=64)


def test_french_and_uppercase_demo_adapters_are_committed():
    assert {"french", "uppercase"} <= set(demo_adapters())


@pytest.mark.parametrize("name", ["french", "uppercase"])
def test_demo_adapter_fits_the_bundled_model_and_is_under_2_mb(name):
    path = demo_adapters()[name]
    spec = inspect_adapter(name, path, BUNDLED, max_rank=16)
    assert spec.rank == 8
    assert (path / "adapter_model.safetensors").stat().st_size < 2 * 2**20
