"""Shared engine fixtures: tiny random Llama checkpoints with a tiny tokenizer, the bundled
model cached once per session, and a minimal block pool and step driver for ModelRunner.

The tiny models are saved with ``save_pretrained`` exactly as a hub checkpoint
would be, so the loader and the reference (HF ``LlamaForCausalLM``) read the
same files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MinistralConfig,
    MinistralForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine import packed_linear, quant_linear
from engine.config import EngineConfig
from engine.engine import Engine
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.sequence import Sequence
from tests.tiny_llama import write_byte_llama, write_random_adapter

TINY_VOCAB = 320
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

# name -> (config class, model class, config overrides)
TINY_CONFIGS = {
    "gqa_untied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "mha_tied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            # A short original context so the scaling changes frequencies the tests reach.
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
        ),
    ),
    # Windows shorter than the tests' prompts, so that a window not applied shows.
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6)),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        # Layers from max_window_layers on are windowed: one full layer, then windowed ones.
        dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7, pad_token_id=0)),
    # LongRoPE over a 64-token original context (the tiny models' max_position_embeddings is 512, so
    # the default attention factor applies); head_dim 16: eight rotary pairs.
    "phi3_longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=64,
             rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.15 * i for i in range(8)],
                               long_factor=[1.5 + 0.9 * i for i in range(8)])),
    ),
    # Phi-4-mini's shape: LongRoPE over three quarters of each head (six of eight pairs rotate).
    "phi4_mini": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, partial_rotary_factor=0.75,
             original_max_position_embeddings=64, tie_word_embeddings=True,
             rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.2 * i for i in range(6)],
                               long_factor=[2.0 + 1.1 * i for i in range(6)])),
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        # Caps low enough to bend the tiny model's scores and logits; a query scale unlike head_dim's.
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
             attn_logit_softcapping=2.0, final_logit_softcapping=8.0),
    ),
    # Multipliers far from 1, so a missing one shows in the logits.
    "granite": (GraniteConfig, GraniteForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
                                                       residual_multiplier=0.5, attention_multiplier=0.1,
                                                       logits_scaling=2.0)),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)),
    "seed_oss": (SeedOssConfig, SeedOssForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         pad_token_id=0)),
    "ministral": (MinistralConfig, MinistralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # A global layer, which takes no RoPE, between two windowed ones.
    "exaone4": (Exaone4Config, Exaone4ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # A global layer (YaRN past a 16-token original context) between two windowed ones (plain RoPE).
    "olmo3": (Olmo3Config, Olmo3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                            "rope_theta": 10000.0}})),
    # The middle layer takes no RoPE and has the window (as SmolLM3's configs derive it).
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, no_rope_layer_interval=2,
                                                       use_sliding_window=True, sliding_window=5)),
    # A global layer between two sliding ones; the sliding layers' RoPE base far from the global
    # one's (which is also scaled), so a layer given the other's tables shows.
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
    ),
}


def write_tiny_tokenizer(folder: Path) -> None:
    words = [f"w{i}" for i in range(TINY_VOCAB - len(SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_tiny_model(folder: Path, kind: str, seed: int = 0, num_layers: int = 3, **changes) -> Path:
    """The tiny ``kind`` checkpoint (with its config's ``changes``) saved in ``folder``."""
    config_cls, model_cls, overrides = TINY_CONFIGS[kind]
    overrides = {**overrides, **changes}
    config = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        # Larger than HF's 0.02 so logits spread over several units and a wrong kernel shows.
        initializer_range=0.2,
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # HF starts biases at zero and norms at one (Gemma's at zero): random ones show a bias
        # dropped or a norm weight loaded into the wrong place.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved checkpoint per tiny config, built once per session."""
    return {kind: build_tiny_model(tmp_path_factory.mktemp(kind), kind) for kind in TINY_CONFIGS}


@pytest.fixture(scope="session")
def bundled_model(engine_cache_dir: Path):
    from engine.loader import load_model

    return load_model("bundled", cache_dir=engine_cache_dir)


class BlockPool:
    """Hands out KV block ids; the real block manager lives in scheduler/."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, seq: Sequence, num_tokens: int, block_size: int) -> None:
        while len(seq.block_table) * block_size < num_tokens:
            seq.block_table.append(self.free.pop())

    def release(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.block_table))
        seq.block_table = []


def chunk(seq: Sequence, start: int, num_tokens: int, pool: BlockPool, block_size: int) -> ScheduledChunk:
    pool.grow(seq, start + num_tokens, block_size)
    return ScheduledChunk(seq=seq, start=start, num_tokens=num_tokens)


def finish_step(plan: StepPlan, logits: torch.Tensor) -> None:
    """Advance every chunk's sequence as the scheduler would, appending greedy tokens."""
    sampling = [c for c in plan.chunks if c.samples]
    assert logits.shape[0] == len(sampling)
    for c in plan.chunks:
        c.seq.num_computed_tokens = c.end
    for c, row in zip(sampling, logits):
        c.seq.output_token_ids.append(int(row.argmax()))


class HFReference:
    """Last-position logits of HF's own model for a token prefix, in float32."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.fixture
def assert_matches_hf() -> Callable[[HFReference, StepPlan, torch.Tensor], None]:
    def check(ref: HFReference, plan: StepPlan, logits: torch.Tensor, atol: float = 1e-3) -> None:
        sampling = [c for c in plan.chunks if c.samples]
        assert logits.shape[0] == len(sampling)
        for c, row in zip(sampling, logits):
            expected = ref.logits(c.seq.all_token_ids[: c.end])
            assert expected.abs().max() > 0.5, "reference logits too flat to catch a wrong kernel"
            diff = (row - expected).abs().max().item()
            assert diff < atol, f"seq {c.seq.seq_id} chunk [{c.start}, {c.end}): max abs diff {diff}"

    return check


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_llama(tmp_path_factory.mktemp("byte-llama"))


@pytest.fixture(scope="session")
def byte_adapter_dir(byte_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_adapter(byte_model_dir, tmp_path_factory.mktemp("byte-adapter") / "a")


def engines_on(defaults: dict) -> Iterator[Callable[..., tuple[Engine, list]]]:
    """For an engine-factory fixture (``yield from``): ``make(**overrides)`` starts an engine on
    ``defaults`` updated by ``overrides`` and returns it with the list its events land in; every
    engine made is shut down when the test ends."""
    engines: list[Engine] = []

    def make(**overrides) -> tuple[Engine, list]:
        engine = Engine(EngineConfig(**{**defaults, **overrides})).start()
        events: list = []
        engine.add_listener(events.append)
        engines.append(engine)
        return engine, events

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def make_byte_engine(byte_model_dir: Path):
    """Engines on a tiny random Llama with the 256-token byte tokenizer (any text spells) and no stop token."""
    yield from engines_on(dict(model=f"dummy:{byte_model_dir}", num_kv_blocks=64, block_size=16, max_model_len=512,
                               max_num_seqs=16, max_num_batched_tokens=256, max_loras=0))


# The engine-loop tests' model: a tiny GQA Llama with an untied head, and HF's greedy tokens on it.
@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["gqa_untied"]


@pytest.fixture(scope="module")
def hf_greedy(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return generate


@pytest.fixture
def make_engine(model_dir: Path, engine_cache_dir: Path):
    yield from engines_on(dict(model=str(model_dir), block_size=4, num_kv_blocks=256, max_num_seqs=16,
                               max_num_batched_tokens=64, max_loras=0, cache_dir=str(engine_cache_dir)))


@pytest.fixture
def amx_microkernel() -> None:
    """Skips the test where oneDNN's bfloat16 micro-kernel does not run (no AMX), for the tests of the
    AMX ops themselves (the bfloat16 panels' and the quantized panels'): both ops ask the same question
    (``cpublas::could_pack(bfloat16)``), so one answer serves both. The dispatch never picks them there."""
    if not (packed_linear.panel_kernel_present() and torch.ops.tiergate.panel_amx_supported()):
        pytest.skip("this CPU does not run oneDNN's bfloat16 micro-kernel (no AMX)")


@pytest.fixture
def fresh_row_thresholds() -> Iterator[None]:
    """The AMX paths' row thresholds (bfloat16 panels, quantized panels) read afresh before and after the test:
    each is cached per value of its variable, and a test that stands in for the CPU's support or sets the
    variable must neither see an earlier test's answer nor leave its own."""
    caches = (packed_linear._amx_rows, quant_linear._panel_rows)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
