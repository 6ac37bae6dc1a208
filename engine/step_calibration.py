"""The step cost model's prior, measured on this machine: a few timed forwards before the engine serves.

The scheduler plans its latency bounds with a linear step cost (scheduler/step_cost.py), fitted online and pulled
toward a prior. A fixed prior is one machine's: on a slower CPU it under-predicted long chunks, so steps ran far past
their bounds while other tenants' streams waited, and the short steps that followed could not correct it (the
prior outweighs them, and the fit clips what it learns from each step; docs/performance.md). So before its first
step the engine thread times what the fit's terms describe, as vLLM's profile run sizes memory before serving: a
prefill chunk from position 0, a decode step of one row and of several, and the prompt scoring
(engine/prompt_scoring.py) that prompt logprobs put each scored row through. Those times make the prior
(``prior_of``); the online fit then starts from this machine's costs rather than another's.

The steps run on KV blocks taken from the pool and given back (nothing is cached from them), on the thread count
the engine's steps start with, and nothing of them reaches listeners, the ledger or the metrics.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from engine.prompt_scoring import FIRST_SLICE_ROWS, PromptRows, score_prompts
from engine.request import MAX_TOP_LOGPROBS, EngineRequest, SamplingParams
from engine.request_state import RequestState
from engine.runner import ModelRunner
from engine.step_timer import StepTimer
from engine.tokenizer import TextTokenizer
from scheduler import Scheduler
from scheduler.config import StepCost
from scheduler.plan import ScheduledChunk, StepFeatures, StepPlan, attention_pairs
from scheduler.sequence import Sequence
from scheduler.step_cost import StepCostModel

log = logging.getLogger(__name__)

PREFILL_TOKENS = 64  # long enough that the rows, not the weights' one read, dominate; short for a large model's start
DECODE_ROWS = 8
REPEATS = 3


@dataclass(frozen=True)
class Calibration:
    """What was timed (seconds, medians) and the prior made of it."""

    prefill_s: float
    decode_s: float
    decode_rows_s: float
    scored_row_s: float
    prior: StepCost


def calibrate(scheduler: Scheduler, runner: ModelRunner, timer: StepTimer, tokenizer: TextTokenizer
              ) -> Calibration | None:
    """Time the steps above and give ``scheduler`` the prior they make; None (the configured prior kept) where the
    KV pool is too small to hold them."""
    config = scheduler.config
    prompt = min(PREFILL_TOKENS, config.max_num_batched_tokens, config.max_model_len - 1)
    rows = min(DECODE_ROWS, config.max_num_seqs)
    tier = config.tiers[0].name
    if prompt < 2:
        return None
    vocab = runner.config.vocab_size
    seqs = [Sequence(f"calibration-{i}", [(7919 * (i + p)) % (vocab - 1) + 1 for p in range(prompt)], tier=tier,
                     output_token_ids=[1]) for i in range(rows)]
    taken = []
    try:
        for seq in seqs:
            if not scheduler.block_manager.can_allocate(seq, prompt + 1):
                break
            scheduler.block_manager.allocate(seq, prompt + 1)
            taken.append(seq)
        if len(taken) < 2:
            return None
        return _measure(scheduler, runner, timer, tokenizer, taken, prompt)
    finally:
        for seq in taken:
            scheduler.block_manager.free(seq)


def _measure(scheduler: Scheduler, runner: ModelRunner, timer: StepTimer, tokenizer: TextTokenizer,
             seqs: list[Sequence], prompt: int) -> Calibration:
    prefill = StepPlan([ScheduledChunk(seqs[0], 0, prompt)])
    decode = StepPlan([ScheduledChunk(seqs[0], prompt, 1)])
    decode_rows = StepPlan([ScheduledChunk(seq, prompt, 1) for seq in seqs])
    if runner.thread_tuner is not None:  # the count the engine's first steps run on
        torch.set_num_threads(runner.thread_tuner.chosen(prompt))
    # Untimed, for the first touches (the weights' pages, the pool's, the kernels' buffers); its final hidden states
    # are the scored rows' input.
    scored = min(FIRST_SLICE_ROWS, prompt)
    _, hidden = runner.execute_with_hidden(prefill, list(range(scored)), nested=True)
    observed: list[tuple[StepPlan, float]] = []
    for _ in range(REPEATS):
        for plan in (prefill, decode, decode_rows):
            timer.start()
            runner.execute(plan, nested=True)
            observed.append((plan, timer.stop()))
    for plan, seconds in observed:
        scheduler.load_estimator.observe_step(seconds, plan.num_tokens, plan.num_tokens if plan is prefill else 0)
    median = lambda plan: statistics.median(s for p, s in observed if p is plan)  # noqa: E731
    prefill_s, decode_s, decode_rows_s = median(prefill), median(decode), median(decode_rows)
    scored_row_s = _scored_row_s(runner, timer, tokenizer, hidden, seqs[0].prompt_token_ids)
    prior = prior_of(prefill_s, decode_s, decode_rows_s, scored_row_s, scheduler.config.step_cost_prior, prompt,
                     len(seqs))
    calibration = Calibration(prefill_s, decode_s, decode_rows_s, scored_row_s, prior)
    scheduler.step_cost = StepCostModel(prior, scheduler.config.step_cost_memory_steps)
    log.info("step cost calibrated: %s", calibration)
    return calibration


def prior_of(prefill_s: float, decode_s: float, decode_rows_s: float, scored_row_s: float, configured: StepCost,
             prompt: int, rows: int) -> StepCost:
    """The prior these times give: a decode row's cost from one row against ``rows``, the fixed cost from one row,
    a prefill token's from the ``prompt``-token chunk, the scored row's as measured. The context and attention terms
    stay ``configured``'s: these short steps barely show them, and the online fit finds them where they grow (long
    prompts)."""
    context = prompt + 1  # the decodes' KV positions each
    per_context, per_pair = configured.per_context_token_s, configured.per_attention_pair_s
    per_decode = max(0.0, (decode_rows_s - decode_s - per_context * context * (rows - 1)) / (rows - 1))
    base = max(0.0, decode_s - per_decode - per_context * context)
    chunk = StepFeatures(prompt, 0, prompt, attention_pairs(0, prompt))
    rest = prefill_s - base - per_context * chunk.context_tokens - per_pair * chunk.attention_pairs
    return StepCost(base, max(0.0, rest / prompt), per_decode, per_context, per_pair, scored_row_s)


def _scored_row_s(runner: ModelRunner, timer: StepTimer, tokenizer: TextTokenizer, hidden: torch.Tensor,
                  prompt: list[int]) -> float:
    """Seconds a scored prompt row adds: engine/prompt_scoring.py's own work over ``hidden`` (rows' final hidden
    states of ``prompt``) at the most alternatives a request may ask: the LM head, softmax and top-k, and each row's
    logprobs with their texts, which alone cost as much again."""
    rows = hidden.shape[0]
    request = EngineRequest("calibration-scores", prompt[:rows + 1],
                            SamplingParams(max_tokens=1, prompt_logprobs=MAX_TOP_LOGPROBS))
    times = []
    for _ in range(REPEATS):
        state = RequestState.create(request, lambda _delta: None, 0, tokenizer)
        timer.start()
        score_prompts(hidden, [PromptRows(state, 0, rows)], runner.head_logits, tokenizer)
        times.append(timer.stop())
    return statistics.median(times) / rows
