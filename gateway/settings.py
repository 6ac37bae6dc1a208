"""Gateway settings: command-line flags first, then TIERGATE_* environment variables, then defaults."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from tiergate_common.env import PREFIX, EnvError, parse


class SettingsError(ValueError):
    """A setting with a value we cannot use; the message names the setting."""


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None  # None: billing's default SQLite file under ./var
    # Ledger rows wait here while the database is down. None: a file of this process's own under
    # var/spool/ (host and pid in its name), so replicas started in one directory never share one.
    spool_path: str | None = None
    redis_url: str | None = None  # None: in-process rate limits
    redis_key_prefix: str = "tiergate:rl"  # one per deployment sharing a Redis
    model: str = "bundled"
    device: str = "cpu"
    # The weights' and activations' dtype. None: float32 on CPU (exact parity with HF; a GGUF served in
    # its own quantization), bfloat16 on CUDA. Given, a GGUF is dequantized to it. bfloat16 on CPU is an
    # opt-in for CPUs with native bf16 (engine/config.py says why).
    dtype: str | None = None
    # HF checkpoints: projections quantized at load (q8_0, q4_0, q4_k; CPU). Refused for a GGUF.
    quantize: str | None = None
    # The KV pool in bytes (a number with a unit: 512MiB, 2GB) or in tokens; both unset: sized from
    # the memory left after the weights (engine/kv_cache.py default_pool_bytes).
    kv_cache_memory: str | None = None
    kv_cache_tokens: int | None = None
    # The pool's format: "auto" (the model's dtype) or "q8_0" (8-bit, llama.cpp's --cache-type-k/v q8_0; CPU).
    kv_cache_dtype: str = "auto"
    # Speculative decoding (engine/speculative.py): "ngram" (prompt lookup), "draft" (the checkpoint
    # draft_model, with the model's tokenizer) or None, and the most tokens a row drafts per step. The
    # draft model's KV pool is its own: draft_kv_blocks blocks, unset: as many tokens as the model's pool.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_kv_blocks: int | None = None
    admin_token: str | None = None  # None: the /admin API is closed
    scheduler_policy: str = "tiered"
    # Fair share: a light tenant's short request runs between two layers of a long step under
    # way instead of after it (engine/step_loop.py). Off: it waits for the step's end.
    express_steps: bool = True
    # "tenant": a request hits only its own tenant's cached prefixes; "shared": anyone's (docs/tenants.md).
    prefix_cache_scope: str = "tenant"
    # Grammars (response_format, structured_outputs, tools): a compile past grammar_compile_timeout_s of CPU
    # time is a 400; a tenant compiles at most grammar_compiles_per_tenant at once (more: 429), on
    # grammar_compile_workers workers of their own; compiled ones are cached per tenant unless
    # grammar_cache_scope is "shared", within grammar_cache_bytes; a token mask that takes more CPU
    # time than grammar_mask_budget_s ends its request.
    grammar_compile_timeout_s: float = 5.0
    grammar_compiles_per_tenant: int = 1
    grammar_compile_workers: int = 2
    grammar_cache_scope: str = "tenant"
    grammar_cache_bytes: int = 64 * 2**20
    grammar_mask_budget_s: float = 0.02
    # The premium tier's TTFT SLO (admission sheds over it) and its KV reserve. None: 0.5 s on a
    # GPU, 2 s on a CPU, where one step of the bundled model at full batch takes ~0.3 s.
    premium_ttft_slo_s: float | None = None
    premium_kv_reserve: float = 0.30
    # The batch tier (scheduler/spare.py): a line starts only with the premium reserve and this share of the
    # KV pool left free, and a step with interactive work grows by at most batch_step_share for batch rows.
    batch_kv_margin: float = 0.1
    batch_step_share: float = 0.2
    # The inter-token latency bound (scheduler/step_budget.py): while streams decode, a step's prefill is
    # cut so that the step is predicted to last at most max_step_s, and at most premium_tpot_slo_s while a
    # premium stream decodes (the tightest decoding tier sets it). None: the device's default (CPU 0.15 s
    # and 0.1 s, prefill chunks of one to two hundred tokens of the bundled model; GPU 0.05 s and
    # 0.025 s: bench/sim/long_prompts.py weighs them against throughput); 0: no bound.
    max_step_s: float | None = None
    premium_tpot_slo_s: float | None = None
    # And at most step_bound_factor times the predicted time of a step of the streams' decodes alone, so
    # that a neighbour's prompt at most stretches their gaps that many times. None: the device's default
    # (CPU 3: a 135M model's decode step is 15-35 ms there, far inside 0.15 s, and 2 cost a loaded engine 15% of
    # its throughput in bench/sim/long_prompts.py against 10% for 3; GPU none); 0: no such bound.
    step_bound_factor: float | None = None
    # With no stream decoding, a step is cut to at most max_prefill_step_s (and no less than 20 times its fixed
    # cost): a request that arrives during it decodes between its layers, whose length is then its gap. None:
    # the device's default (CPU 0.5 s; GPU none, where a whole step is shorter than a CPU's layer); 0: no bound.
    max_prefill_step_s: float | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 2048
    max_loras: int = 4
    # Adapters' weights: float32 or bfloat16. None: bfloat16 on CPU over a quantized model (their
    # rounding is far finer than the model's own; half the bytes a step reads), else the model's dtype.
    lora_dtype: str | None = None
    default_max_tokens: int = 256  # when a request names none: bounds what TPM reserves for it
    max_body_bytes: int = 1 << 20
    tokenizer_threads: int = 2  # long prompts are tokenized on this many threads, off the event loop
    # The tokens a list prompt's entries (or one /tokenize call) may hold together (gateway/prompt_lists.py).
    max_prompt_list_tokens: int = 1 << 17
    # Slow clients: a request's head must arrive within header_timeout_s of the connection (or of its
    # first byte on a kept-alive one), its body within body_timeout_s of the head; else 408 and close.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Open connections (and requests in flight) past which a request gets 503 + Retry-After and is closed.
    max_connections: int = 1000
    auth_cache_ttl_s: float = 5.0
    # While the database is unreachable, keys already seen keep working this long past their TTL.
    auth_stale_if_error_s: float = 300.0
    # How often every replica checks the database for keys revoked elsewhere (the CLI, another replica).
    auth_revocation_poll_s: float = 0.5
    # How often the token counts of running requests are saved to their open ledger rows.
    ledger_checkpoint_s: float = 1.0
    # An open ledger row whose process has not saved it for this long is closed as `interrupted`.
    ledger_orphan_after_s: float = 60.0
    rate_window_s: float = 60.0
    max_queued: int = 256
    drain_timeout_s: float = 30.0
    # A concurrency slot is a lease in Redis that a heartbeat renews while the request runs, so a
    # replica that dies without releasing its slots frees them within this time.
    concurrency_lease_s: float = 30.0
    # Also export the endpoint picker's series under vLLM's names (vllm:num_requests_waiting, ...),
    # so default EPP, KEDA and HPA configurations work unchanged.
    vllm_metric_names: bool = False
    # Budgets: how often every replica checks the database for changed budgets and prices, and where
    # soft-threshold warnings are POSTed (None: only logged and counted).
    budget_poll_s: float = 1.0
    budget_webhook_url: str | None = None
    # The Batch API (gateway/batch_driver.py): lines each replica runs at once, how long a claimed line stays
    # its replica's without a renewal (a replica that dies gives its lines up after this), how often the
    # driver looks for lines and ended batches. Files: OpenAI's limits. The tokens a tenant's unfinished
    # batches may hold are the tenant's own setting (billing/tenants.py, batch_queue_tokens).
    batch_window: int = 8
    batch_lease_s: float = 30.0
    batch_poll_s: float = 0.5
    batch_max_file_bytes: int = 200 * 2**20
    batch_max_file_lines: int = 50_000
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise SettingsError(f"device must be cpu or cuda, not {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise SettingsError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantize not in (None, *QUANTIZE_KINDS):
            raise SettingsError(f"quantize must be one of {', '.join(QUANTIZE_KINDS)}, not {self.quantize!r}")
        if self.quantize is not None and self.device != "cpu":
            raise SettingsError("quantize is served by the CPU kernels only: on CUDA serve the checkpoint as it is")
        if self.quantize is not None and self.dtype not in (None, "float32"):
            raise SettingsError("quantize computes activations in float32: leave dtype unset or float32")
        if self.lora_dtype not in (None, "float32", "bfloat16"):
            raise SettingsError(f"lora_dtype must be float32 or bfloat16, not {self.lora_dtype!r}")
        if self.kv_cache_memory is not None and self.kv_cache_tokens is not None:
            raise SettingsError("give kv_cache_memory or kv_cache_tokens, not both")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise SettingsError(f"kv_cache_tokens must be at least 1, not {self.kv_cache_tokens}")
        if self.kv_cache_dtype not in ("auto", "q8_0"):
            raise SettingsError(f"kv_cache_dtype must be auto or q8_0, not {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "q8_0" and self.device != "cpu":
            raise SettingsError("kv_cache_dtype q8_0 is read by the CPU attention kernel only: on CUDA leave it auto")
        if self.speculative not in (None, "ngram", "draft"):
            raise SettingsError(f"speculative must be ngram, draft or unset, not {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise SettingsError("speculative draft needs a draft model (--draft-model DIR)")
        if self.draft_model and self.speculative != "draft":
            raise SettingsError("a draft model is used only with --speculative draft")
        if self.draft_kv_blocks is not None and (not self.draft_model or self.draft_kv_blocks < 1):
            raise SettingsError("draft_kv_blocks is a positive block count, and needs a draft model")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise SettingsError(f"num_speculative_tokens must be in 1..16, not {self.num_speculative_tokens}")
        if self.scheduler_policy not in ("tiered", "fcfs"):
            raise SettingsError(f"scheduler policy must be tiered or fcfs, not {self.scheduler_policy!r}")
        if self.prefix_cache_scope not in ("tenant", "shared"):
            raise SettingsError(f"prefix cache scope must be tenant or shared, not {self.prefix_cache_scope!r}")
        if self.grammar_cache_scope not in ("tenant", "shared"):
            raise SettingsError(f"grammar cache scope must be tenant or shared, not {self.grammar_cache_scope!r}")
        for name in ("grammar_compile_timeout_s", "grammar_mask_budget_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive, not {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, not {self.port}")
        if self.premium_ttft_slo_s is not None and not self.premium_ttft_slo_s > 0:
            raise SettingsError(f"premium_ttft_slo_s must be positive, not {self.premium_ttft_slo_s}")
        for name in ("max_step_s", "premium_tpot_slo_s", "max_prefill_step_s"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise SettingsError(f"{name} must be zero (no bound) or positive, not {getattr(self, name)}")
        if self.step_bound_factor is not None and not (self.step_bound_factor == 0 or self.step_bound_factor > 1):
            raise SettingsError(f"step_bound_factor must be zero (no bound) or more than 1, "
                                f"not {self.step_bound_factor}")
        if not 0 <= self.premium_kv_reserve < 1:
            raise SettingsError(f"premium_kv_reserve must be in [0, 1), not {self.premium_kv_reserve}")
        if not 0 <= self.batch_kv_margin < 1 or not 0 <= self.batch_step_share < float("inf"):
            raise SettingsError("batch_kv_margin must be in [0, 1) and batch_step_share zero or more, not "
                                f"{self.batch_kv_margin} and {self.batch_step_share}")
        if not self.drain_timeout_s >= 0:
            raise SettingsError(f"drain_timeout_s must be zero or more, not {self.drain_timeout_s}")
        if not 1 <= self.concurrency_lease_s <= 3600:
            raise SettingsError(f"concurrency_lease_s must be in [1, 3600], not {self.concurrency_lease_s}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("max_model_len", "default_max_tokens", "max_body_bytes", "max_queued", "tokenizer_threads",
                     "max_connections", "max_prompt_list_tokens", "grammar_compiles_per_tenant",
                     "grammar_compile_workers", "grammar_cache_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1")
        for name in ("batch_window", "batch_lease_s", "batch_poll_s", "batch_max_file_bytes",
                     "batch_max_file_lines"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be more than zero, not {getattr(self, name)}")
        for name in ("auth_revocation_poll_s", "ledger_checkpoint_s", "budget_poll_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive, not {getattr(self, name)}")
        if not self.ledger_orphan_after_s > 2 * self.ledger_checkpoint_s:
            raise SettingsError("ledger_orphan_after_s must be more than twice ledger_checkpoint_s")
        if self.auth_stale_if_error_s < 0:
            raise SettingsError(f"auth_stale_if_error_s must not be negative, not {self.auth_stale_if_error_s}")

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)

    @property
    def premium_slo_s(self) -> float:
        """The premium TTFT SLO in force: the setting, else the device's default."""
        if self.premium_ttft_slo_s is not None:
            return self.premium_ttft_slo_s
        return 2.0 if self.device == "cpu" else 0.5

    @property
    def step_bound_s(self) -> float | None:
        """The longest step planned while any stream decodes (None: unbounded)."""
        return _bound(self.max_step_s, 0.15 if self.device == "cpu" else 0.05)

    @property
    def prefill_step_bound_s(self) -> float | None:
        """The longest step planned while no stream decodes (None: unbounded)."""
        return _bound(self.max_prefill_step_s, 0.5 if self.device == "cpu" else None)

    @property
    def step_factor(self) -> float | None:
        """How many times their decode step alone a step beside streams may last (None: no such bound)."""
        return _bound(self.step_bound_factor, 3.0 if self.device == "cpu" else None)

    @property
    def premium_tpot_s(self) -> float | None:
        """The longest step planned while a premium stream decodes (None: only ``step_bound_s``)."""
        return _bound(self.premium_tpot_slo_s, 0.1 if self.device == "cpu" else 0.025)


def _bound(setting: float | None, default: float | None) -> float | None:
    if setting is None:
        return default
    return setting or None  # 0 turns the bound off


_KINDS_OF_NONE_DEFAULTS = {"premium_ttft_slo_s": float, "max_step_s": float, "premium_tpot_slo_s": float,
                           "max_prefill_step_s": float, "step_bound_factor": float,
                           "kv_cache_tokens": int, "draft_kv_blocks": int}
QUANTIZE_KINDS = ("q8_0", "q4_0", "q4_k")  # engine/model.py QUANT_BLOCK: the gateway does not import torch here
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``512MiB``, ``2GB``, ``1.5GiB`` or a plain number of bytes; a clear error otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise SettingsError(f"kv_cache_memory must be a size like 512MiB or 2GB, not {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise SettingsError(f"kv_cache_memory must be more than zero bytes, not {text!r}")
    return value


def _convert(name: str, raw: str, default: Any) -> Any:
    kind = type(default) if default is not None else _KINDS_OF_NONE_DEFAULTS.get(name, str)
    try:
        return parse(PREFIX + name.upper(), raw, kind)
    except EnvError as e:
        raise SettingsError(str(e)) from None


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``overrides`` (flags; None values ignored), then the environment, then defaults."""
    environ = os.environ if environ is None else environ
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in fields(Settings):
        raw = environ.get(PREFIX + f.name.upper())
        if raw not in (None, ""):
            values[f.name] = _convert(f.name, raw, getattr(defaults, f.name))
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    return replace(defaults, **values)
