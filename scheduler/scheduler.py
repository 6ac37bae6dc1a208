"""The step planner: continuous batching with chunked prefill over paged KV blocks.

Each ``schedule()`` builds one step: decodes of running sequences first (one token each), then prefill
chunks queue by queue under the token budget. Blocks for every chunk are allocated before the plan is
returned; when a sequence needs a block and none is left, the policy names a sequence to preempt by
recompute. ``update()`` applies the step's sampled tokens afterwards.

Parts of the planning live beside it: whether a waiting sequence can start (scheduler/admission.py),
express admissions (scheduler/express.py), the spare-capacity tiers' work (scheduler/spare.py),
speculative drafts (scheduler/drafts.py) and the step's update (scheduler/step_update.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Collection

from scheduler.admission import frees_enough, start_need
from scheduler.block_manager import BlockManager
from scheduler.checks import check_config, check_new_sequence, check_scheduler_invariants
from scheduler.config import SchedulerConfig
from scheduler.drafts import fit_drafts
from scheduler.express import plan_express_decodes, plan_express_step, start_express
from scheduler.load import LoadEstimator, TierLoad, tier_loads
from scheduler.plan import ScheduledChunk, StepPlan
from scheduler.policy import NO_ADAPTER, NO_BLOCKS, NO_SLOT, Policy, make_policy
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.spare import plan_spare
from scheduler.step_budget import (StepTimeBound, first_token_target_s, prefill_step_target_s, scaled_share,
                                   step_target_s)
from scheduler.step_builder import StepBuilder
from scheduler.step_cost import StepCostModel
from scheduler.step_update import apply_step


class Scheduler:
    """Plans engine steps under one policy; see the module docstring.

    Not thread-safe: the engine calls it from its step thread only (aborts
    from other threads must be handed to that thread). "Arrival" means the
    order of ``add()`` calls.
    """

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        check_config(config)
        self.config = config
        self.clock = clock
        self._priority = {t.name: t.priority for t in config.tiers}
        self._arrival: dict[str, int] = {}
        self._arrivals = itertools.count()
        self.policy: Policy = make_policy(config, self._arrival)
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.policy.caps(),
            scope_by_tenant=config.prefix_cache_scope == "tenant",
            long_context_after=config.long_context_after,
        )
        self.load_estimator = LoadEstimator(config)
        self.step_cost = StepCostModel(config.step_cost_prior, config.step_cost_memory_steps)
        self.waiting: dict[str, deque[Sequence]] = {q: deque() for q in self.policy.queue_names()}
        self.running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}
        self._express_last = False  # the previous step held a queue's prefill for express requests

    # -- requests ------------------------------------------------------------

    def max_sequence_tokens(self, tier: str) -> int:
        """The longest prompt + max_tokens a sequence of ``tier`` can ever hold (static; any thread)."""
        # The last sampled token is never computed, hence the + 1.
        blocks = self.block_manager.cap_for(tier)
        if self.policy.is_spare(tier):  # it starts only with the headroom left free (plan_spare)
            blocks = min(blocks, self.config.num_blocks - self.policy.spare_headroom_blocks())
        fits = blocks * self.config.block_size + 1
        return min(fits, self.config.max_model_len)

    def add(self, seq: Sequence, sibling_of: str | None = None) -> None:
        """Queue a new sequence; ValueError (and nothing changed) if it can never run. A choice of an
        n > 1 request whose first choice (``sibling_of``) is live joins it: it takes that one's place
        in arrival order and goes to the front of its queue, to be admitted next, as part of a
        request already admitted rather than a new one."""
        if seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        check_new_sequence(seq, self.config, self.max_sequence_tokens, self.block_manager.blocks_for)
        group_arrival = self._arrival.get(sibling_of) if sibling_of is not None else None
        self._live[seq.seq_id] = seq
        self._arrival[seq.seq_id] = next(self._arrivals) if group_arrival is None else group_arrival
        seq.joins_group = group_arrival is not None
        self._enqueue(seq, arriving=not seq.joins_group)
        self.load_estimator.observe_prompt(seq.tier, seq.num_prompt_tokens)

    def abort(self, seq_id: str) -> Sequence | None:
        """Remove a sequence and free its blocks at once; None if it is not live."""
        return self._remove(seq_id, SequenceStatus.ABORTED)

    def finish(self, seq_id: str) -> Sequence | None:
        """The engine saw a stop condition: free the sequence's blocks."""
        return self._remove(seq_id, SequenceStatus.FINISHED)

    def _remove(self, seq_id: str, status: SequenceStatus) -> Sequence | None:
        seq = self._live.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self._dequeue(seq)
        self.block_manager.forget(seq)
        self._arrival.pop(seq_id, None)
        seq.status = status
        return seq

    def _enqueue(self, seq: Sequence, arriving: bool) -> None:
        """Into its waiting queue: at the back when new, at the front after a preemption."""
        queue = self.waiting[self.policy.queue_of(seq)]
        if arriving:
            queue.append(seq)
        else:
            queue.appendleft(seq)
        seq.waiting_since = self.clock()
        self.policy.enqueued(seq)

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting[self.policy.queue_of(seq)].remove(seq)
        if seq.waiting_since is not None:
            seq.queue_time_s += max(0.0, self.clock() - seq.waiting_since)
            seq.waiting_since = None
        self.policy.dequeued(seq)

    def get(self, seq_id: str) -> Sequence | None:
        return self._live.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    # -- one step ------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step; blocks for every chunk are allocated, preemptions already done."""
        step = StepBuilder(StepPlan(), self.config.max_num_batched_tokens, self.policy.charge_prefill)
        queues = [q for q in self.policy.queue_names() if not self.policy.is_spare(q)]
        prefilling = self.prefilling()
        spare_decodes = []
        for seq in sorted(self.running, key=self.policy.rank):
            if seq.is_prefilling:
                continue
            if self.policy.is_spare(self.policy.queue_of(seq)):
                spare_decodes.append(seq)  # planned after every other tier's work (plan_spare)
            elif (
                step.budget > 0
                and seq.seq_id not in step.preempted
                and seq.has_tokens_left
                and self.grow_running(seq, seq.num_computed_tokens + 1, step)
            ):
                step.add(seq, 1)
        decodes = [c.seq for c in step.plan.chunks]
        cost = self.step_cost.coefficients()
        target = step_target_s(self.config, decodes, cost) if decodes else prefill_step_target_s(self.config, cost)
        self.bound(step, target, keeps_gaps=bool(decodes))
        kept = 0
        for i, queue in enumerate(queues):
            keep = self._kept_for_worse(queues[i + 1 :], prefilling, step)
            kept += keep
            if not self._express_last:
                start_express(self, queue, step, keep)
            self.schedule_prefills(queue, prefilling[queue], step, keep, True)
        self._express_last = bool(step.held)
        if kept and step.budget > 0:
            # Tokens kept for worse queues that they could not use go back to everyone.
            prefilling = self.prefilling()
            for queue in queues:
                self.schedule_prefills(queue, prefilling[queue], step, 0, False)
        plan_spare(self, step, spare_decodes)
        return step.finished()

    def prefilling(self) -> dict[str, list[Sequence]]:
        """Running sequences with prompt left to compute, per queue, in the policy's order."""
        prefilling: dict[str, list[Sequence]] = {q: [] for q in self.policy.queue_names()}
        for seq in sorted(self.running, key=self.policy.rank):
            if seq.is_prefilling:
                prefilling[self.policy.queue_of(seq)].append(seq)
        return prefilling

    def schedule_express(self, step_adapters: frozenset[str] | None = None, under_way: Collection[str] = ()) -> StepPlan:
        """A step of express requests alone, each whole (scheduler/express.py); empty when nobody qualifies.
        ``step_adapters``, ``under_way``: the adapters and sequence ids of the step under way, if any."""
        return plan_express_step(self, step_adapters, under_way)

    def schedule_express_decodes(self, under_way: Collection[str], waited_s: float,
                                 next_chance_s: float = 0.0) -> StepPlan:
        """A decode step, inside a step under way, of what an express step started (scheduler/express.py)."""
        return plan_express_decodes(self, under_way, waited_s, next_chance_s)

    def bound(self, step: StepBuilder, target: float | None, keeps_gaps: bool = True) -> None:
        """Put ``step`` under the time bound (scheduler/step_budget.py) of ``target``, if any and tighter than the
        bound it has (a first token's after a step with nobody decoding was bounded: ``keeps_gaps`` False)."""
        if target is None or (step.time is not None and step.time.target_s <= target):
            return
        overrun = self.step_cost.overrun() if keeps_gaps else 1.0
        step.bound(StepTimeBound(target, self.step_cost.coefficients(), self.config.min_chunk, overrun, keeps_gaps))

    def _first_token(self, step: StepBuilder, seq: Sequence) -> None:
        """``seq`` was given a chunk: if that chunk makes its first token, bound the rest of the step by its tier."""
        if step.chunks[seq.seq_id].samples:
            self.bound(step, first_token_target_s(self.config, seq))

    def _kept_for_worse(self, worse: list[str], prefilling: dict[str, list[Sequence]], step: StepBuilder) -> int:
        if not any(self.waiting[q] or prefilling[q] for q in worse):
            return 0
        given = sum(c.num_tokens for c in step.plan.chunks if self.policy.queue_of(c.seq) in worse)
        share = self.policy.min_share_tokens()
        if step.time is not None:
            share = scaled_share(share, step.room_at_bound, self.config.max_num_batched_tokens)
        return max(0, share - given)

    def schedule_prefills(
        self, queue: str, prefilling: list[Sequence], step: StepBuilder, keep: int, may_preempt: bool,
        headroom: int | None = None,
    ) -> None:
        """Continue ``queue``'s running prefills, then admit its waiting sequences in order (a spare-capacity
        queue's, given ``headroom``, each only if its whole prompt fits with that many blocks left free).

        Under fair share a waiting sequence of a tenant served less than a running prefill's
        is admitted before that prefill continues: else a flood's long prefills would take
        every step's budget while a neighbour's short request waited behind them.
        """
        queued = self.waiting[queue]
        skipped: set[str] = set()
        held = step.held.get(queue)
        for seq in prefilling:
            if step.budget - keep <= 0:
                break
            if seq.seq_id in step.preempted or (held is not None and seq.tenant not in held):
                continue
            if held is None:
                self._admit_waiting(queued, step, keep, may_preempt, skipped, before=seq, headroom=headroom)
                if seq.seq_id in step.preempted:  # it gave way to one admitted before it
                    continue
            chunk = step.chunks.get(seq.seq_id)
            start = chunk.end if chunk else seq.num_computed_tokens
            n = min(seq.num_tokens - start, step.room(seq, start, keep))
            if n <= 0:
                continue
            if may_preempt:
                ok = self.grow_running(seq, start + n, step)
            else:
                ok = self.block_manager.can_allocate(seq, start + n)
                if ok:
                    self.block_manager.allocate(seq, start + n)
            if ok:
                step.add(seq, n)
                self._first_token(step, seq)
        if held is None:
            self._admit_waiting(queued, step, keep, may_preempt, skipped, headroom=headroom)
        if any(s.seq_id in step.preempted for s in queued):
            # Preempted for want of blocks this step: worse queues must not take the blocks it will
            # need. (Under fair share a less-served tenant of the same queue may still go first.)
            step.admission_closed = True

    def _admit_waiting(self, queued: deque[Sequence], step: StepBuilder, keep: int, may_preempt: bool,
                       skipped: set[str], before: Sequence | None = None, headroom: int | None = None) -> None:
        """Admit ``queued`` in the policy's order (only those that go ``before`` a running prefill); a
        spare-capacity queue's (``headroom`` given) each beside its whole prompt with that many blocks free."""
        while not step.admission_closed and step.budget - keep > 0:
            seq = self.policy.next_to_admit(queued, skipped)
            if seq is None or seq.seq_id in step.preempted:
                return  # a sequence preempted this step stays next in line: nobody overtakes it
            if before is not None and not self.policy.goes_before(seq, before):
                return
            # The spare is kept only beside running sequences: alone, a request that needs the whole
            # pool must still start.
            spare = self.config.express_spare_blocks if self.running else 0
            if headroom is not None:
                spare = max(spare, headroom)
            reason = self.start_sequence(seq, step, keep, may_preempt, spare, whole=headroom is not None)
            if reason is None:
                self._first_token(step, seq)
            elif reason in (NO_SLOT, NO_BLOCKS):
                step.admission_closed = True  # the policy's order holds: nobody overtakes
            elif reason == NO_ADAPTER:
                skipped.add(seq.seq_id)  # it waits for a slot; later requests with resident adapters may go

    def start_sequence(self, seq: Sequence, step: StepBuilder, keep: int, may_preempt: bool, spare: int = 0,
                        whole: bool = False) -> str | None:
        """Start ``seq`` (preempting as the policy says if ``may_preempt``) with ``spare`` blocks left free
        (``whole``: once its whole prompt has its blocks); None, or why it cannot start."""
        while True:
            reason, cached, n = start_need(self.config, self.block_manager, self.running, seq, step, keep, spare,
                                           whole)
            if reason is None:
                break
            if not may_preempt:
                return reason
            victim = self.policy.victim_for_waiting(
                seq, reason, self.running, lambda seqs: frees_enough(self.config, self.block_manager, seq, step, keep, seqs, spare, whole)
            )
            if victim is None:
                return reason
            if victim.tier == seq.tier:  # a fair turn (policy.py): the victim never takes seq's place back
                victim.gave_way_to = seq.seq_id
            self._preempt(victim, seq, step)
        start = len(cached) * self.config.block_size
        self.block_manager.allocate(seq, start + n, cached)
        seq.num_computed_tokens = start
        if seq.num_preemptions == 0:  # its first admission: what the prefix cache saved it is billed
            seq.num_cached_tokens = min(start, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        seq.joins_group = False
        self._dequeue(seq)
        self.running.append(seq)
        step.add(seq, n)
        return None

    def grow_running(self, seq: Sequence, num_tokens: int, step: StepBuilder, may_preempt: bool = True) -> bool:
        """Blocks for ``seq`` up to ``num_tokens`` positions, preempting as the policy says (``may_preempt``)."""
        if self.block_manager.blocks_for(num_tokens) <= len(seq.block_table):
            return True
        while not self.block_manager.can_allocate(seq, num_tokens):
            if not may_preempt:
                return False
            self._preempt(self.policy.victim_for_running(seq, self.running), seq, step)
            if seq.seq_id in step.preempted:  # itself, or with a sibling of its group
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _preempt(self, victim: Sequence, cause: Sequence, step: StepBuilder) -> None:
        """Recompute later: free its blocks and put it first in its queue; its running group goes with it.

        The choices of one request stream together: one left running while a sibling waits
        would hold blocks the request cannot finish with.
        """
        group = [victim]
        if victim.group is not None:
            group += [s for s in self.running if s.group == victim.group and s is not victim]
        for seq in reversed(group):  # the victim ends up first in the queue
            step.drop(seq)
            self.block_manager.free(seq)
            self.running.remove(seq)
            seq.recompute_until = max(seq.recompute_until, seq.num_computed_tokens)
            # Spare work is preempted by design and priced for it: its recompute is its own tier's.
            seq.recompute_charged_tier = seq.tier if self.policy.is_spare(self.policy.queue_of(seq)) else cause.tier
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
            seq.status = SequenceStatus.WAITING
            self._enqueue(seq, arriving=False)
            step.preempted.add(seq.seq_id)
            step.plan.preempted.append(seq)

    def add_drafts(self, plan: StepPlan, chunk: ScheduledChunk, drafts: list[int]) -> int:
        """How many leading ``drafts`` the decode ``chunk`` of ``plan`` also computes: those that fit without
        preempting anybody (scheduler/drafts.py)."""
        return fit_drafts(self.config, self.block_manager, plan, chunk, drafts)

    def update(self, plan: StepPlan, sampled: dict[str, int], accepted: dict[str, list[int]] | None = None) -> None:
        """Apply a step: advance every chunk, append the tokens of chunks that sample (after the
        drafts ``accepted`` of each drafted chunk; the blocks of those rejected go back)."""
        apply_step(plan, sampled, self._live, self.block_manager, self.policy.charge_decode,
                   self.config.long_context_after, accepted)

    # -- load and accounting -------------------------------------------------

    def observe_step(self, duration_s: float, num_tokens: int, num_prefill_tokens: int,
                     plan: StepPlan | None = None) -> None:
        """Feed one finished step's duration into the TTFT prediction and, given its ``plan``, the step cost model."""
        self.load_estimator.observe_step(duration_s, num_tokens, num_prefill_tokens)
        if plan is not None and not plan.is_empty:
            self.step_cost.observe_step(plan, duration_s)

    def load(self) -> dict[str, TierLoad]:
        """Per tier: queue depth, running and predicted TTFT of a new request."""
        return tier_loads(self._live.values(), self._priority, self.load_estimator, self.policy)

    def counter_spread(self) -> dict[str, float]:
        """Per tier (fair share only): max minus min virtual token counter over backlogged tenants."""
        return self.policy.counter_spread()

    def kv_usage(self) -> tuple[dict[str, int], int]:
        """Blocks held per tier (a shared block counts for each tier using it) and the pool size."""
        used = self.block_manager.used_by_tier()
        return {tier: used.get(tier, 0) for tier in self._priority}, self.config.num_blocks

    def adapter_usage(self) -> tuple[frozenset[str], frozenset[str]]:
        """LoRA adapters of the running batch, and of requests still waiting."""
        running = frozenset(s.adapter for s in self.running if s.adapter is not None)
        waiting = frozenset(s.adapter for q in self.waiting.values() for s in q if s.adapter is not None)
        return running, waiting

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping is off; for tests."""
        waiting = [s for q in self.waiting.values() for s in q]
        check_scheduler_invariants(self.config, self.block_manager, waiting, self.running, list(self._live.values()))
