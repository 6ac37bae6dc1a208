"""One in-flight request on the engine side: its sequence, sampler state, detokenizer and sink."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.choices import ChoiceGroup, choice_seq_id
from engine.events import FinishEvent
from engine.grammar import GrammarMatcher
from engine.request import Delta, EngineRequest, TokenLogprob, Usage
from engine.sampler import SampledToken, make_generator
from engine.tokenizer import TextTokenizer
from scheduler.sequence import Sequence


class OutsideGrammar(ValueError):
    """A token the request's grammar does not accept."""


@dataclass
class RequestState:
    request: EngineRequest
    seq: Sequence
    sink: Callable[[Delta], None]  # called on the engine thread; must not block
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # None when greedy
    queued_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    finished: bool = False
    grammar: GrammarMatcher | None = None  # has accepted every output token so far
    index: int = 0  # which choice of an n > 1 or list-prompt request
    group: ChoiceGroup | None = None  # the choices of an n > 1 or list-prompt request
    # Prompt logprobs scored so far (engine/prompt_scoring.py), the first token's first; None if not asked.
    prompt_scores: list[TokenLogprob] | None = None

    @classmethod
    def create(cls, request: EngineRequest, sink: Callable[[Delta], None], index: int, tokenizer: TextTokenizer
               ) -> RequestState:
        """The state of choice ``index`` of ``request``: the ``index % n``-th choice of its ``index // n``-th
        prompt; its grammar's matcher is set by the engine once the grammar is compiled."""
        params = request.params
        prompt, choice = divmod(index, params.n)
        # Seeded choices are reproducible and differ from each other; a list prompt's entry gets the
        # choices it would get alone.
        if choice and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + choice)
        seq = Sequence(
            seq_id=choice_seq_id(request.request_id, index) if request.num_sequences > 1 else request.request_id,
            prompt_token_ids=list(request.prompts[prompt]),
            tier=request.tier,
            adapter=request.adapter,
            max_tokens=params.max_tokens,
            tenant=request.tenant,
            weight=request.tenant_weight,
            # One prompt's choices are preempted together; a list prompt's entries each finish on their own.
            group=f"{request.request_id}/{prompt}" if params.n > 1 else None,
        )
        prompt_scores = None
        if params.prompt_logprobs is not None and choice == 0:  # later choices take their lead's
            first = seq.prompt_token_ids[0]
            prompt_scores = [TokenLogprob(first, tokenizer.id_to_token_text(first), None)]
            seq.reads_prefix_cache = seq.num_prompt_tokens == 1
        return cls(
            request=request,
            seq=seq,
            sink=sink,
            detokenizer=IncrementalDetokenizer(tokenizer.tokenizer, seq.prompt_token_ids, params.stop),
            generator=make_generator(params),
            index=index,
            prompt_scores=prompt_scores,
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @functools.cached_property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt's token ids as a tensor, built once: a repetition penalty reads them every step."""
        return torch.tensor(self.seq.prompt_token_ids, dtype=torch.long)

    def on_tokens(self, run: list[SampledToken], tokenizer: TextTokenizer, max_model_len: int) -> Delta:
        """Account the step's tokens (already appended to the sequence; more than one when drafts were
        accepted, engine/speculative.py) through the grammar, and build their one delta; tokens after
        one that ends the output are dropped. OutsideGrammar if the grammar rejects one."""
        deltas = []
        for i, token in enumerate(run):
            if self.grammar is not None and not self.grammar.accept(token.token_id):
                raise OutsideGrammar(token.token_id)
            deltas.append(self.on_token(token, tokenizer, max_model_len, behind=len(run) - 1 - i))
            if deltas[-1].finish_reason is not None:
                break
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        return dataclasses.replace(
            last, text="".join(d.text for d in deltas), token_ids=tuple(t for d in deltas for t in d.token_ids),
            logprobs=tuple(lp for d in deltas for lp in d.logprobs), prompt_logprobs=deltas[0].prompt_logprobs)

    def on_token(self, sampled: SampledToken, tokenizer: TextTokenizer, max_model_len: int, behind: int = 0) -> Delta:
        """Account one sampled token (already appended to the sequence) and build its delta.

        ``behind``: tokens appended after this one in the same step (accepted drafts, engine/speculative.py);
        if this token ends the output, they are dropped from the sequence, which then ends too.
        """
        prompt_logprobs = None
        if self.first_token_at is None:
            self.first_token_at = time.time()
            prompt_logprobs = tuple(self.prompt_scores) if self.prompt_scores is not None else None
        params = self.request.params
        token_id = sampled.token_id
        num_output = len(self.seq.output_token_ids) - behind
        may_stop = num_output >= params.min_tokens
        is_stop_token = may_stop and (token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in tokenizer.eos_token_ids))
        text = "" if is_stop_token else self.detokenizer.add_token(token_id, may_stop)

        finish_reason = None
        if is_stop_token or self.detokenizer.stopped or (self.grammar is not None and self.grammar.is_terminated):
            finish_reason = "stop"
        elif num_output >= params.max_tokens or self.seq.num_tokens - behind >= max_model_len:
            finish_reason = "length"
        if finish_reason:
            text += self.detokenizer.flush()
            if behind:  # the output ends here: what follows was never given
                del self.seq.output_token_ids[-behind:]

        logprobs: tuple[TokenLogprob, ...] = ()
        if params.logprobs is not None and sampled.logprob is not None:
            top = tuple((tid, tokenizer.id_to_token_text(tid), lp) for tid, lp in sampled.top)
            logprobs = (TokenLogprob(token_id, tokenizer.id_to_token_text(token_id), sampled.logprob, top),)
        return Delta(
            text=text,
            token_ids=(token_id,),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=finish_reason,
            usage=self.usage() if finish_reason else None,
            index=self.index,
        )

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.seq.num_prompt_tokens,
            completion_tokens=len(self.seq.output_token_ids),
            cached_tokens=self.seq.num_cached_tokens,
        )

    def finish_event(self, status: str, finish_reason: str) -> FinishEvent:
        usage = self.usage()
        return FinishEvent(
            request_id=self.request_id,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            status=status,
            finish_reason=finish_reason,
            tier=self.request.tier,
            adapter=self.request.adapter,
            queued_at=self.queued_at,
            first_token_at=self.first_token_at,
            finished_at=time.time(),
            queue_s=self.seq.queue_time_s,
        )
