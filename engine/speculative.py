"""Speculative decoding in the step loop: which rows draft and how many tokens, and turning a drafted
step's logits into each row's tokens.

A decode step on a CPU (and at small batch on a GPU) is bound by reading the weights, so a row can
compute a few guessed tokens after its newest one in the same step for little more than one, and
keep those the model agrees with. Drafts come from prompt lookup (engine/ngram.py) or from a small
draft model (engine/draft_model.py). The loop calls three things: ``draft`` after the scheduler's
plan (each eligible decode chunk gets its drafts, through ``Scheduler.add_drafts``, which never
preempts for them), ``sample`` after the forward pass (each row's logits adjusted and masked position by
position as if the drafts before it were its output, then verified by engine/spec_sampling.py), and
``observe`` once the step's tokens and time are known (acceptance per row, the batch gate's rates,
counts for the metrics).

Adaptive, so that speculation never makes decoding slower: a row whose recent drafts were mostly
rejected stops drafting (and tries again now and then), and engine/spec_gate.py lets a step of so
many decoding rows draft as many tokens a row (none, 1, 2, ... ``num_tokens``) as gives such steps the
most tokens per second, as measured on this machine: as the batch grows each drafted position costs
more of the step, and at a large batch a step is no longer bound by weight reads and speculation
turns itself off. Where the gate found drafted positions dear, a row drafts no further than its last
run of kept drafts earned (``_Row.length``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.draft_model import DraftModel, DraftRequest
from engine.events import StepDrafts
from engine.grammar import GrammarMatcher, mask_logits
from engine.logit_adjustments import adjust_logits_, adjusts_logits
from engine.ngram import NgramIndex
from engine.request_state import RequestState
from engine.sampler import SampledToken, greedy_tokens, is_greedy
from engine.spec_gate import BatchGate, draft_lengths
from engine.spec_sampling import verify_row
from scheduler import ScheduledChunk, Scheduler, StepPlan

log = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_DRAFT_TOKENS = 16  # --num-speculative-tokens at most


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_tokens: int = 4  # drafts per row and step at most
    ngram_min: int = 2  # prompt lookup: the shortest suffix it matches
    ngram_max: int = 4
    # A row drafts while the running mean of the fraction of its drafts accepted stays above this.
    min_acceptance: float = 0.2
    acceptance_memory: float = 0.7  # weight of the past in that running mean, per drafted step
    retry_after_steps: int = 16  # a row that stopped drafting tries again after this many steps
    adaptive: bool = True  # False: every row drafts whatever its acceptance and the batch (tests, measurements)
    # Adaptive: a step of more decoding rows never drafts. On a CPU such a step is bound by compute,
    # not weight reads (bench/RESULTS.md, speculative decoding): the batch gate's exploring steps
    # there would only cost.
    max_rows: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_DRAFT_TOKENS}")


@dataclass
class _Row:
    """What one sequence's drafting has learned so far."""

    index: NgramIndex | None  # prompt lookup's; None when a draft model drafts
    acceptance: float = 0.5  # running mean of the fraction of drafts accepted
    resting: int = 0  # steps left before it drafts again
    # Where drafted positions are dear, the drafts it may propose next step: a run kept whole doubles it,
    # one cut short sets it to the drafts kept (one at least). Guesses are right or wrong in runs (a
    # copied span, then an edit), so the last outcome predicts the next; a row at an edit then risks
    # one position rather than all of them.
    length: int = MAX_DRAFT_TOKENS

    def learn(self, drafted: int, accepted: int, memory: float) -> None:
        self.acceptance = memory * self.acceptance + (1 - memory) * accepted / drafted
        self.length = min(MAX_DRAFT_TOKENS, 2 * drafted) if accepted == drafted else max(1, accepted)


class Speculator:
    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, eos_token_ids: tuple[int, ...],
                 drafter: DraftModel | None = None) -> None:
        if (config.method == "draft") != (drafter is not None):
            raise ValueError("a draft model drafts exactly when the speculative method is 'draft'")
        self.config = config
        self.drafter = drafter  # method "draft": the draft model (engine/draft_model.py)
        self._drawn_from: dict[str, torch.Tensor] = {}  # this step's sampled drafts' q, by sequence
        self._draft_kv_known: dict[str, int] = {}  # rows the draft model ran this step: their tokens then
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self._rows: dict[str, _Row] = {}
        self.gate = BatchGate(draft_lengths(config.num_tokens))
        self._decode_rows: int | None = None  # this step's, if it is a pure decode step the gate learns from
        self._length = 0  # this step's drafts per row at most

    # -- before the forward pass ---------------------------------------------

    def draft(self, plan: StepPlan, state_of: Callable[[str], RequestState | None]) -> None:
        """Give the plan's eligible decode chunks their drafts (blocks permitting)."""
        decodes = [c for c in plan.chunks if c.is_decode and c.samples]
        self._forget_gone(state_of)
        if self.drafter is not None:
            self._settle_draft_kv(plan)
        self._decode_rows = len(decodes) if decodes and len(decodes) == len(plan.chunks) else None
        self._length = 0
        if not decodes or (self.config.adaptive and len(decodes) > self.config.max_rows):
            return
        self._length = self.gate.draft_length(len(decodes)) if self.config.adaptive else self.config.num_tokens
        if not self._length:
            return
        threshold = self.config.min_acceptance if self.config.adaptive else 0.0
        rows = []
        for chunk in decodes:
            state = state_of(chunk.seq.seq_id)
            if state is None or not state.request.speculative:
                continue
            row = self._row(chunk)
            if row.resting:
                row.resting -= 1
                continue
            if row.acceptance < threshold:
                row.resting = self.config.retry_after_steps
                row.acceptance = threshold  # one try when it wakes, judged afresh
                continue
            rows.append((chunk, state, row))
        if self.drafter is not None:
            self._draft_with_model(plan, [(chunk, state) for chunk, state, _ in rows])
            return
        for chunk, state, row in rows:
            drafts = self._allowed(row.index.propose(self._row_length(row)), state)
            if drafts:
                self.scheduler.add_drafts(plan, chunk, drafts)

    def _row(self, chunk: ScheduledChunk) -> _Row:
        seq = chunk.seq
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = _Row(NgramIndex(self.config.ngram_min, self.config.ngram_max)
                                                if self.drafter is None else None)
        if row.index is None:
            return row
        known = len(row.index.tokens)
        if known < seq.num_prompt_tokens:
            row.index.extend(seq.prompt_token_ids[known:])
            known = seq.num_prompt_tokens
        row.index.extend(seq.output_token_ids[known - seq.num_prompt_tokens:])
        return row

    def _row_length(self, row: _Row) -> int:
        """How many tokens ``row`` drafts this step at most: the batch gate's length, and where the gate
        found drafted positions dear (it chose fewer than the most), no more than the row's last run
        earned (``_Row.length``). Where they are cheap (one row, bound by weight reads) a try costs
        little and every row drafts the gate's length."""
        if not self.config.adaptive or self._length == self.config.num_tokens:
            return self._length
        return min(self._length, row.length)

    def _allowed(self, drafts: list[int], state: RequestState) -> list[int]:
        """The leading drafts the row could emit: none past a stop token (its output would end there)
        nor one its grammar rejects or that ends its grammar."""
        stops = self.eos_token_ids | set(state.request.params.stop_token_ids)
        for i, token in enumerate(drafts):
            if token in stops:
                drafts = drafts[:i]
                break
        if state.grammar is None or not drafts:
            return drafts
        return drafts[:_grammar_prefix(state.grammar, drafts)]

    def _draft_with_model(self, plan: StepPlan, rows: list[tuple[ScheduledChunk, RequestState]]) -> None:
        """The draft model's proposals for ``rows``, batched, given to their chunks."""
        requests = []
        for chunk, state in rows:
            seq, params = chunk.seq, state.request.params
            if state.grammar is not None and not is_greedy(params):
                # A drawn draft that ends its grammar could be neither verified (nothing may follow it)
                # nor cut (a cut that depends on the drawn token biases the output).
                continue
            limit = min(self._row_length(self._rows[seq.seq_id]), seq.max_tokens - len(seq.output_token_ids) - 1)
            if limit < 1:
                continue
            requests.append(DraftRequest(seq.seq_id, seq.all_token_ids, limit, params, state.generator,
                                         self.eos_token_ids | frozenset(params.stop_token_ids), state.grammar))
            self._draft_kv_known[seq.seq_id] = seq.num_tokens
        try:
            proposals = self.drafter.propose(requests) if requests else {}
        except Exception:  # the draft model's failure costs its rows their drafts, not their requests
            log.exception("draft model failed; its rows decode without drafts this step")
            for request in requests:
                self.release(request.seq_id)
            return
        for chunk, _ in rows:
            proposal = proposals.get(chunk.seq.seq_id)
            if proposal is None or not proposal.tokens:
                continue
            n = self.scheduler.add_drafts(plan, chunk, proposal.tokens)
            if n and proposal.probs is not None:
                self._drawn_from[chunk.seq.seq_id] = proposal.probs[:n]

    def _settle_draft_kv(self, plan: StepPlan) -> None:
        """Before a step drafts: rows the draft model ran in a step that was not verified keep only the
        tokens they had then; preempted rows give their draft KV back."""
        for seq_id, known in self._draft_kv_known.items():
            self.drafter.keep(seq_id, known)
        self._draft_kv_known.clear()
        self._drawn_from.clear()
        for seq in plan.preempted:
            self.drafter.release(seq.seq_id)

    def release(self, seq_id: str) -> None:
        """A sequence left the engine (finished, aborted, failed): forget it; its draft KV blocks go back."""
        self._rows.pop(seq_id, None)
        self._draft_kv_known.pop(seq_id, None)
        self._drawn_from.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.release(seq_id)

    def _forget_gone(self, state_of: Callable[[str], RequestState | None]) -> None:
        if len(self._rows) > 64:
            for seq_id in [s for s in self._rows if state_of(s) is None]:
                del self._rows[seq_id]

    # -- after the forward pass ----------------------------------------------

    def sample(self, logits: torch.Tensor, sampling: list[ScheduledChunk], states: list[RequestState],
               eos_token_ids: tuple[int, ...], mask_budget_s: float | None) -> tuple[list[list[SampledToken]], list[int]]:
        """Each sampling chunk's tokens (its accepted drafts, then one sampled token) from the step's
        logits (one row per chunk plus one per draft), and the chunks whose grammar went over its
        budget. Each position is adjusted (penalties, bias) and masked as if the drafts before it were
        the row's output."""
        counts = [1 + len(c.draft_token_ids) for c in sampling]
        params, prompts, outputs = [], [], []
        for chunk, state in zip(sampling, states):
            p = state.request.params
            for i in range(1 + len(chunk.draft_token_ids)):
                params.append(p)
                prompts.append(state.prompt_ids if p.repetition_penalty != 1.0 else None)
                outputs.append(state.seq.output_token_ids + chunk.draft_token_ids[:i])
        if any(adjusts_logits(p) for p in params):
            adjust_logits_(logits, params, prompts, outputs, eos_token_ids)
        too_slow = _mask_positions(logits, sampling, states, counts, mask_budget_s)
        logits = logits.float().cpu()
        # One argmax over the step rather than one per row: a call's overhead is most of a row's.
        best = greedy_tokens(logits) if any(is_greedy(s.request.params) for s in states) else None
        runs, row = [], 0
        for chunk, state, n in zip(sampling, states, counts):
            runs.append(verify_row(logits[row:row + n], chunk.draft_token_ids, state.request.params, state.generator,
                                   self._drawn_from.pop(chunk.seq.seq_id, None),
                                   best[row:row + n] if best is not None else None))
            row += n
        return runs, too_slow

    def observe(self, sampling: list[ScheduledChunk], runs: list[list[SampledToken]], seconds: float) -> StepDrafts:
        """The step's tokens (``runs``, one per sampling chunk) and its time: the rows' acceptance, the
        batch gate's rates, and the step's counts."""
        step = StepDrafts()
        memory = self.config.acceptance_memory
        drafted = [(c, len(run) - 1 if run[-1].error is None else 0) for c, run in zip(sampling, runs)
                   if c.draft_token_ids]
        if self._decode_rows is not None:
            tokens = sum(len(run) for run in runs if run[-1].error is None)
            self.gate.observe(self._decode_rows, self._length if drafted else 0, tokens, seconds)
            self._decode_rows = None
        if self.drafter is not None:  # each row's draft KV keeps exactly its accepted tokens
            kept = {c.seq.seq_id: accepted for c, accepted in drafted}
            for seq_id, known in self._draft_kv_known.items():
                self.drafter.keep(seq_id, known + kept.get(seq_id, 0))
            self._draft_kv_known.clear()
        for chunk, accepted in drafted:
            step.drafted += len(chunk.draft_token_ids)
            step.accepted += accepted
            row = self._rows.get(chunk.seq.seq_id)
            if row is not None:
                row.learn(len(chunk.draft_token_ids), accepted, memory)
        return step


def accepted_drafts(produced: list[tuple[ScheduledChunk, list[SampledToken]]]) -> dict[str, list[int]]:
    """For ``Scheduler.update``: the drafts each drafted chunk kept, by sequence."""
    return {c.seq.seq_id: [t.token_id for t in run[:-1]] for c, run in produced if c.draft_token_ids}


def _grammar_prefix(matcher: GrammarMatcher, drafts: list[int]) -> int:
    """How many leading drafts the grammar accepts without reaching its end; the matcher is left as it was.
    A token that ends the grammar is not drafted: nothing may be sampled after it."""
    walked = taken = 0
    for token in drafts:
        if not matcher.accept(token):  # a rejected token leaves the matcher where it was
            break
        walked += 1
        if matcher.is_terminated:
            break
        taken += 1
    matcher.rollback(walked)
    return taken


def _mask_positions(logits: torch.Tensor, sampling: list[ScheduledChunk], states: list[RequestState],
                    counts: list[int], budget_s: float | None) -> list[int]:
    """Mask every position of every grammar row with its matcher walked through the drafts before it
    (and rolled back after); the chunks (indices into ``sampling``) whose grammar went over ``budget_s``."""
    firsts, row = [], 0
    for n in counts:
        firsts.append(row)
        row += n
    matchers: list[GrammarMatcher | None] = [None] * row
    for first, state in zip(firsts, states):
        matchers[first] = state.grammar
    slow_rows = set(mask_logits(logits, matchers, budget_s))
    too_slow = [i for i, first in enumerate(firsts) if first in slow_rows]
    for i, (chunk, state) in enumerate(zip(sampling, states)):
        matcher = state.grammar
        if matcher is None or not chunk.draft_token_ids:
            continue
        walked = 0
        for draft in chunk.draft_token_ids:
            if not matcher.accept(draft):  # checked when drafted: a grammar that changed its mind is a bug
                raise RuntimeError(f"sequence {chunk.seq.seq_id}: a draft its grammar took is rejected now")
            walked += 1
            position = firsts[i] + walked
            if mask_logits(logits[position:position + 1], [matcher], budget_s) and i not in too_slow:
                too_slow.append(i)
        matcher.rollback(walked)
    return too_slow
