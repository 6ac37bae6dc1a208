"""Engine settings: which model, where, and how large the KV pool and batches are."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig, TierConfig, default_tiers
from tiergate_common.env import CACHE_DIR


def default_cache_dir() -> str:
    """TIERGATE_CACHE_DIR, or ~/.cache/tiergate when it is unset or empty."""
    return CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "tiergate")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (x86 AVX-512 BF16 or AMX tiles)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class EngineConfig:
    model: str = "bundled"  # "bundled", an HF directory, a .gguf file, or "dummy:<config.json | dir>"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU (a GGUF in its own quantization), bfloat16 on CUDA
    block_size: int = 16
    # The KV pool: an exact block count, else a budget in bytes or tokens, else sized from the memory
    # left after the weights (engine/kv_cache.py default_pool_bytes).
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    # The pool's format: "auto" (the model's dtype) or "q8_0" (8 bits a value and a float16 scale per 32,
    # engine/kv_quant.py; CPU, head sizes a multiple of 32): 3.8x the tokens in the same bytes, and
    # a long context's decode reads that much less.
    kv_cache_dtype: str = "auto"
    # HF checkpoints: projections quantized at load into this block format (q8_0, q4_0, q4_k; CPU).
    quantize: str | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "tiered"
    tiers: tuple[TierConfig, ...] = field(default_factory=default_tiers)
    standard_min_share: float = 0.1
    fair_share: bool = True  # tiered policy: tenants of one tier take turns by virtual token counter
    # Fair share: a light tenant's short request runs between two layers of a long step under way
    # rather than after it (engine/step_loop.py).
    express_between_layers: bool = True
    express_spare_blocks: int = 4  # left free for them by other admissions (scheduler/config.py)
    # The inter-token latency bound (scheduler/step_budget.py): while streams decode, no step is planned
    # longer than this or than a decoding tier's tpot_slo_s (``tiers``). None: only the tiers' bounds.
    max_step_s: float | None = None
    step_bound_factor: float | None = None  # and no longer than this times its decodes alone (None: no such bound)
    max_prefill_step_s: float | None = None  # with no stream decoding, no step planned longer than this (None: no bound)
    min_prefill_chunk: int | None = None  # prefill tokens a bounded step still takes; None: one block
    # Time a few steps before serving and make the step cost model's prior of them (engine/step_calibration.py).
    calibrate_step_cost: bool = True
    # The batch tier's KV margin and step share (SchedulerConfig.spare_kv_margin, spare_step_share).
    batch_kv_margin: float = 0.1
    batch_step_share: float = 0.2
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "tenant"  # "tenant" or "shared" (see scheduler/block_manager.py)
    # Grammars (engine/grammar_compiler.py): a compile past its budget is refused; compiled ones are
    # cached per tenant unless "shared", within a bound in bytes; a grammar whose work for one token
    # takes longer than its budget (CPU seconds, a small part of a step) ends its request. The budget
    # sits above what a legitimate grammar costs (docs/performance.md, "Grammars").
    grammar_compile_timeout_s: float = 5.0
    grammar_compile_workers: int = 2
    grammar_cache_bytes: int = 64 * 2**20
    grammar_cache_scope: str = "tenant"
    grammar_mask_budget_s: float = 0.02
    # Speculative decoding (engine/speculative.py): "ngram" (prompt lookup), "draft" (the checkpoint
    # ``draft_model``, engine/draft_model.py) or None, and the most tokens a row drafts per step.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # a model spec as ``model``, with the same tokenizer
    # The draft model's own KV pool, in blocks of ``block_size``. None: as many tokens as the base pool.
    draft_num_kv_blocks: int | None = None
    # False: every row drafts whatever its acceptance and the batch's size (tests and measurements).
    speculative_adaptive: bool = True
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 16
    # The adapters' weights: "float32", "bfloat16" or None (Engine._lora_stack_dtype decides).
    lora_dtype: str | None = None
    cache_dir: str = field(default_factory=default_cache_dir)
    seed: int = 0  # for dummy weights

    def __post_init__(self) -> None:
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("speculative 'draft' needs a draft model, and a draft model needs speculative 'draft'")
        if self.draft_num_kv_blocks is not None and (self.draft_model is None or self.draft_num_kv_blocks < 1):
            raise ValueError("draft_num_kv_blocks is a positive block count, for a draft model")
        if self.lora_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"lora_dtype must be float32 or bfloat16, not {self.lora_dtype!r}")
        if self.kv_cache_dtype not in ("auto", "q8_0"):
            raise ValueError(f"kv_cache_dtype must be auto or q8_0, not {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "q8_0" and self.device != "cpu":
            raise ValueError("kv_cache_dtype q8_0 is read by the CPU attention kernel only; on CUDA leave it auto")

    def scheduler_config(self, num_blocks: int, max_model_len: int, long_context_after: int | None = None
                         ) -> SchedulerConfig:
        """The scheduler's part of this config, for a pool of ``num_blocks`` and the model's context
        (and its long-context regime, ``ModelConfig.long_context_after``)."""
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_model_len,
            max_loras=self.max_loras, enable_prefix_caching=self.enable_prefix_caching,
            prefix_cache_scope=self.prefix_cache_scope, policy=self.policy, fair_share=self.fair_share,
            tiers=self.tiers, standard_min_share=self.standard_min_share, long_context_after=long_context_after,
            express_spare_blocks=self.express_spare_blocks if self.express_steps_on else 0,
            max_step_s=self.max_step_s, step_bound_factor=self.step_bound_factor,
            max_prefill_step_s=self.max_prefill_step_s, min_prefill_chunk=self.min_prefill_chunk,
            spare_kv_margin=self.batch_kv_margin, spare_step_share=self.batch_step_share)

    @property
    def native_gguf(self) -> bool:
        """Whether a GGUF is served in its own quantization: on CPU unless a dtype is asked for, which
        dequantizes it (float32: exactly the file's values, as HF transformers computes them)."""
        return self.device == "cpu" and self.dtype is None

    @property
    def express_steps_on(self) -> bool:
        """Whether light tenants' requests may run between a step's layers: fair share is what picks them."""
        return self.express_between_layers and self.policy == "tiered" and self.fair_share

    def kv_dtype(self):
        """What the KV pool stores: the serving dtype (``torch_dtype``), or "q8_0"."""
        return "q8_0" if self.kv_cache_dtype == "q8_0" else self.torch_dtype()

    def torch_dtype(self):
        """The dtype to serve in. On CPU, float32 unless asked: it keeps exact parity with HF, and
        bfloat16 is served only where the CPU computes it natively (AVX-512 BF16 or AMX), since
        elsewhere torch emulates it slower than float32; float16 is not served on CPU."""
        import torch

        if self.dtype is None:
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        try:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}") from None
        if self.device == "cpu" and dtype == torch.float16:
            raise ValueError("dtype float16 is not served on CPU: use float32 or, with native bf16, bfloat16")
        if self.device == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
            raise ValueError("dtype bfloat16 needs a CPU with native bf16 (AVX-512 BF16 or AMX); this one has "
                             "neither, so serve float32")
        return dtype
