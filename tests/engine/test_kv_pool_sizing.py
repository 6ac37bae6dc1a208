"""The KV pool's size: bytes or tokens when asked (flags, TIERGATE_KV_CACHE_MEMORY / _TOKENS), else a
fraction of the memory left after the weights, capped at a quarter context per batch slot, at least
one whole context; bad sizes are refused naming the setting."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import bytes_per_token, default_pool_bytes, pool_blocks
from engine.model_config import ModelConfig
from gateway.cli import main
from gateway.settings import SettingsError, load_settings, parse_bytes

CONFIG = ModelConfig.from_dict({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
})
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, two layers, two kv heads of 16, float32


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert bytes_per_token(CONFIG, torch.float32) == PER_TOKEN


def test_the_default_pool_is_a_fraction_of_what_is_available_within_its_cap_and_floor():
    seqs, context = 32, 2048
    cap = seqs * context // 4 * PER_TOKEN
    assert default_pool_bytes(CONFIG, torch.float32, 10 * cap, seqs, context) == cap
    assert default_pool_bytes(CONFIG, torch.float32, cap, seqs, context) == cap // 2
    # Little memory left: still one sequence of the whole context.
    assert default_pool_bytes(CONFIG, torch.float32, 1000, seqs, context) == context * PER_TOKEN


def test_a_pool_asked_in_tokens_or_bytes_gets_that_many_blocks():
    assert pool_blocks(CONFIG, 16, torch.float32, "cpu", None, 1000, 32, 2048) == 63  # 1000 tokens, rounded up
    assert pool_blocks(CONFIG, 16, torch.float32, "cpu", 16 * PER_TOKEN * 10, None, 32, 2048) == 10
    with pytest.raises(ValueError, match="bytes or in tokens, not both"):
        pool_blocks(CONFIG, 16, torch.float32, "cpu", 1 << 20, 100, 32, 2048)


def test_the_default_pool_reads_the_machines_available_memory():
    blocks = pool_blocks(CONFIG, 16, torch.float32, "cpu", None, None, 32, 2048)
    # This tiny model's cap is far below any machine's memory: the cap it is.
    assert blocks == 32 * 2048 // 4 * PER_TOKEN // (16 * PER_TOKEN)


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5GiB", 3 << 29),
                                         ("1048576", 1 << 20), ("64 kb", 64000)])
def test_sizes_are_read_with_their_units(text, value):
    assert parse_bytes(text) == value


def test_the_pool_settings_come_from_flags_then_the_environment():
    env = {"TIERGATE_KV_CACHE_MEMORY": "1GiB"}
    assert load_settings({}, env).kv_cache_bytes == 1 << 30
    assert load_settings({"kv_cache_memory": "2GiB"}, env).kv_cache_bytes == 2 << 30
    assert load_settings({}, {"TIERGATE_KV_CACHE_TOKENS": "8192"}).kv_cache_tokens == 8192
    assert load_settings({}, {}).kv_cache_bytes is None and load_settings({}, {}).kv_cache_tokens is None


@pytest.mark.parametrize("overrides, message", [
    ({"kv_cache_memory": "lots"}, "kv_cache_memory must be a size like 512MiB or 2GB, not 'lots'"),
    ({"kv_cache_memory": "0MiB"}, "kv_cache_memory must be more than zero bytes"),
    ({"kv_cache_memory": "1GiB", "kv_cache_tokens": 10}, "give kv_cache_memory or kv_cache_tokens, not both"),
    ({"kv_cache_tokens": 0}, "kv_cache_tokens must be at least 1"),
])
def test_bad_pool_sizes_are_refused_naming_the_setting(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides, {})


def test_the_cli_refuses_a_bad_pool_size_in_one_line(capsys):
    assert main(["serve", "--kv-cache-memory", "12 parsecs"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_cache_memory must be a size like 512MiB" in err


def test_a_cpu_pool_is_zeroed_on_huge_pages_where_linux_gives_them(tmp_path):
    """The pool is asked for transparent huge pages before its zeros touch it (attention reads a context's blocks
    from all over it); with THP in madvise mode nothing else would put it on them."""
    from pathlib import Path

    from engine.kv_cache import KVCache

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off here")
    cache = KVCache.allocate(CONFIG, num_blocks=8192, block_size=16, device="cpu", dtype=torch.float32)  # 64 MiB
    start = cache.layers[0].data_ptr()
    end = start + sum(layer.nbytes for layer in cache.layers)
    assert all(float(layer.abs().max()) == 0.0 for layer in cache.layers)
    huge_kb, inside = 0, False  # over every mapping the pool overlaps: the advice splits its mapping
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < end and start < high
        elif inside and line.startswith("AnonHugePages:"):
            huge_kb += int(line.split()[1])
    assert huge_kb >= 2048, "the pool got no huge page"
