"""Scheduler settings: the KV pool, the per-step budget and the tiers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierConfig:
    name: str
    priority: int  # lower runs first
    ttft_slo_s: float | None  # None: no SLO, never shed for latency
    kv_reserve_fraction: float = 0.0  # share of the pool only this tier (or better) may use
    # Time per output token: while a sequence of this tier decodes, no step is planned to last longer
    # (scheduler/step_budget.py). None: only SchedulerConfig.max_step_s bounds its steps.
    tpot_slo_s: float | None = None
    # A spare-capacity tier (OpenAI's Batch API lines): admitted only while no request of a tier
    # without this flag waits and the KV pool keeps ``SchedulerConfig.spare_kv_margin`` free beyond
    # the reserves; planned after every other tier's work in a step, preempted before any of it.
    spare_only: bool = False


def default_tiers(
    premium_slo_s: float = 0.5, premium_kv_reserve: float = 0.30, standard_slo_s: float | None = None,
    premium_tpot_slo_s: float | None = None,
) -> tuple[TierConfig, ...]:
    """The tiers billing knows; the one table the gateway, the engine and the benches build on."""
    return (
        TierConfig("premium", priority=0, ttft_slo_s=premium_slo_s, kv_reserve_fraction=premium_kv_reserve,
                   tpot_slo_s=premium_tpot_slo_s),
        TierConfig("standard", priority=1, ttft_slo_s=standard_slo_s),
        TierConfig("batch", priority=2, ttft_slo_s=None, spare_only=True),
    )


@dataclass(frozen=True)
class StepCost:
    """Step time as a linear cost: ``base_s + per_prefill_token_s * prefill tokens + per_decode_seq_s *
    decode rows + per_context_token_s * context tokens + per_attention_pair_s * prefill attention pairs
    + per_scored_row_s * scored prompt rows`` (bench/sim/step_cost.py fits the first four offline; the
    scheduler's online fit learns all six).

    The pair term is a prefill chunk's attention: each of its rows attends to every position before it,
    so a chunk deep into a long prompt costs per token in proportion to its depth; without it a chunk
    at position 1,900 is predicted as cheap as one at 0. Zero by default: a GPU's flash attention
    barely shows it, and the online fit finds it where it shows (a CPU).

    The scored-row term is prompt logprobs: each scored row goes through the LM head and a softmax over
    the vocabulary, a large share of a small model's per-token work that a plain prefill row skips.
    Its prior is a sixth of a prefill token's (the bundled model's LM head and softmax beside its layers);
    the online fit finds the rest."""

    base_s: float = 0.012
    per_prefill_token_s: float = 6e-4
    per_decode_seq_s: float = 1.5e-4
    per_context_token_s: float = 3e-6
    per_attention_pair_s: float = 0.0
    per_scored_row_s: float = 1e-4

    def as_tuple(self) -> tuple[float, float, float, float, float, float]:
        return (self.base_s, self.per_prefill_token_s, self.per_decode_seq_s, self.per_context_token_s,
                self.per_attention_pair_s, self.per_scored_row_s)


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64  # sequences running in one step
    max_num_batched_tokens: int = 512  # tokens computed in one step (decodes + prefill chunks)
    max_model_len: int = 2048
    max_loras: int = 4  # distinct adapters in one step (device slots)
    enable_prefix_caching: bool = True
    policy: str = "tiered"  # "tiered" or "fcfs"
    # Inside a tier (tiered policy only): admit from the tenant with the lowest virtual token
    # counter (scheduler/fairness.py) instead of in arrival order; decode dearer than prefill.
    fair_share: bool = True
    fair_prefill_weight: float = 1.0
    fair_decode_weight: float = 2.0
    # Blocks that admissions in arrival or fair order leave free, for express requests (a light
    # tenant's, ``Policy.express``): with the pool full, one that arrives during a step could not
    # run between its layers, where nobody can be preempted (Scheduler.schedule_express).
    express_spare_blocks: int = 0
    # "tenant": a sequence hits only cached blocks of its own tenant; "shared": of anyone.
    prefix_cache_scope: str = "tenant"
    tiers: tuple[TierConfig, ...] = field(default_factory=default_tiers)
    # Models with two position regimes (Phi-3's LongRoPE): a sequence longer than this many tokens
    # is computed in the long one (``Sequence.is_long_context``). Its keys differ between regimes,
    # so one that crosses is recomputed and the prefix cache keeps the regimes apart. None: one regime.
    long_context_after: int | None = None
    # Under sustained premium load, standard still gets this share of each
    # step's token budget when it has work waiting.
    standard_min_share: float = 0.1
    # Predicted TTFT before any step has been observed (CPU-scale priors), and
    # the weight of each new step in the moving averages.
    prior_step_time_s: float = 0.05
    prior_prefill_tokens_per_s: float = 1000.0
    prior_prompt_tokens: int = 256
    load_ema_alpha: float = 0.1
    # Inter-token latency bound (scheduler/step_budget.py): while sequences decode, a step's prefill
    # is cut so that its predicted time stays under the tightest of this and the decoding tiers'
    # ``tpot_slo_s``; None and no tier's TPOT SLO: no bound. A step still takes at least
    # ``min_prefill_chunk`` prefill tokens (None: one block), so every prompt keeps advancing.
    max_step_s: float | None = None
    # And at most ``step_bound_factor`` times the predicted time of a step of those decodes alone (None:
    # no such bound): a neighbour's prompt then stretches a stream's gaps by that factor at most, on any
    # machine and model, where a bound in seconds fits one of them.
    step_bound_factor: float | None = None
    # A step with no stream decoding is cut to at most ``max_prefill_step_s`` too (None: only its token budget),
    # but never below ``step_budget.PREFILL_STEP_BASES`` times the step's fixed cost: a request that arrives
    # while it runs lives on express steps between its layers, so its layers must be short.
    max_prefill_step_s: float | None = None
    min_prefill_chunk: int | None = None
    # The step cost model (scheduler/step_cost.py): its coefficients before any step is observed
    # (CPU-scale, the bundled model's order of magnitude), and how many recent steps the fit weighs.
    step_cost_prior: StepCost = field(default_factory=StepCost)
    step_cost_memory_steps: int = 200
    # Spare-capacity tiers (``TierConfig.spare_only``): a sequence of one starts only if the pool keeps
    # the other tiers' reserves plus this share of it free, so interactive work that arrives finds room
    # without preempting; and a step that carries interactive work grows by at most this share of its
    # predicted time for spare rows, so that work's first tokens and gaps stay about what they were.
    spare_kv_margin: float = 0.1
    spare_step_share: float = 0.2

    @property
    def min_chunk(self) -> int:
        """Prefill tokens a step under the time bound still takes (one block unless set)."""
        return self.min_prefill_chunk if self.min_prefill_chunk is not None else self.block_size
