"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo): HF's scores, each delivered once,
however the prompt is chunked, batched, cached or preempted."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.events import StepEvent
from engine.prompt_scoring import (FIRST_SLICE_ROWS, MIN_SLICE_ROWS, SLICE_ROWS, SLICE_S, PromptRows, rows_to_score,
                                   score_prompts)
from engine.request import Delta, EngineRequest, SamplingParams, TokenLogprob
from scheduler.plan import ScheduledChunk
from scheduler.sequence import Sequence

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(length)]


@pytest.fixture(scope="module")
def hf_scores(model_dir):
    """HF's log-softmax rows of a whole prompt in one forward: row i scores token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)

    return score


def _run(engine, requests: list[EngineRequest]) -> dict[str, list[Delta]]:
    async def one(request: EngineRequest) -> list[Delta]:
        return [delta async for delta in engine.generate(request)]

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return {r.request_id: deltas for r, deltas in zip(requests, asyncio.run(main()))}


def _only_scores(deltas: list[Delta]) -> tuple[TokenLogprob, ...]:
    carrying = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1, f"prompt logprobs came in {len(carrying)} deltas"
    return carrying[0]


def _assert_hf_scores(scores: tuple[TokenLogprob, ...], prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert [s.token_id for s in scores] == prompt
    assert scores[0].logprob is None and scores[0].top == () and scores[0].rank is None
    for i, s in enumerate(scores[1:]):
        row = reference[i]
        expected = row[prompt[i + 1]].item()
        assert s.logprob == pytest.approx(expected, abs=1e-4), f"prompt token {i + 1}"
        # Ties within float noise may fall either way between two implementations.
        assert 1 + int((row > expected + 1e-4).sum()) <= s.rank <= 1 + int((row > expected - 1e-4).sum())
        assert len(s.top) == k
        values, _ = torch.topk(row, k)
        assert [lp for _, _, lp in s.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert [row[tid].item() for tid, _, _ in s.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_hfs_over_chunked_prefills_beside_other_requests(make_engine, hf_scores):
    engine, events = make_engine()  # 64-token steps: this prompt takes three
    prompt = _prompt(150, seed=1)
    scored = EngineRequest("scored", prompt, SamplingParams(max_tokens=3, prompt_logprobs=3, **GREEDY))
    neighbours = [EngineRequest(f"n{i}", _prompt(30, seed=10 + i), SamplingParams(max_tokens=20, **GREEDY))
                  for i in range(3)]
    out = _run(engine, [*neighbours, scored])

    _assert_hf_scores(_only_scores(out["scored"]), prompt, hf_scores(prompt), k=3)
    assert all(d.prompt_logprobs is None for n in neighbours for d in out[n.request_id])
    chunks = [it for e in events if isinstance(e, StepEvent) for it in e.items if it.request_id == "scored"]
    assert sum(it.tokens > 1 for it in chunks) >= 3, "the prompt was not prefilled in chunks"


def test_a_request_scoring_its_prompt_reads_nothing_from_the_prefix_cache(make_engine, hf_scores):
    engine, _ = make_engine()
    prompt = _prompt(40, seed=2)

    def usage(request_id: str, **params) -> tuple:
        deltas = _run(engine, [EngineRequest(request_id, prompt, SamplingParams(max_tokens=2, **GREEDY, **params))])
        return deltas[request_id][-1].usage, deltas[request_id]

    usage("warm")
    scored_usage, deltas = usage("scored", prompt_logprobs=0)
    assert scored_usage.cached_tokens == 0
    _assert_hf_scores(_only_scores(deltas), prompt, hf_scores(prompt), k=0)
    assert usage("after")[0].cached_tokens > 0, "the cache held the prompt all along"


def test_only_the_first_choice_scores_and_later_choices_still_read_its_cached_prompt(make_engine, hf_scores):
    engine, events = make_engine()
    prompt = _prompt(40, seed=3)
    request = EngineRequest("two", prompt, SamplingParams(max_tokens=4, n=2, prompt_logprobs=1, temperature=1.0,
                                                          seed=7, ignore_eos=True))
    deltas = _run(engine, [request])["two"]
    scores = _only_scores(deltas)
    assert next(d.index for d in deltas if d.prompt_logprobs is not None) == 0
    _assert_hf_scores(scores, prompt, hf_scores(prompt), k=1)
    computed = sum(it.tokens for e in events if isinstance(e, StepEvent) for it in e.items if it.request_id == "two")
    assert computed < 2 * len(prompt), "the second choice recomputed the prompt"


def _preempted_mid_prefill(events: list, prompts: dict[str, list[int]]) -> list[tuple[str, int]]:
    """(request, prompt tokens it had computed) for each request first preempted before its prompt was done."""
    computed: dict[str, int] = {}
    done: set[str] = set()
    found = []
    for item in (it for e in events if isinstance(e, StepEvent) for it in e.items):
        if item.request_id in done:  # preempted before: its recompute is not counted
            continue
        computed.setdefault(item.request_id, 0)
        if item.is_recompute:
            if computed[item.request_id] < len(prompts[item.request_id]):
                found.append((item.request_id, computed[item.request_id]))
            done.add(item.request_id)
        else:
            computed[item.request_id] += item.tokens
    return found


def test_preempted_scoring_requests_deliver_each_score_once_and_equal_to_hfs(make_engine, hf_scores):
    # 16 blocks of 4 tokens cannot hold eight 40-token sequences, and 16-token steps chunk every
    # prompt: requests are preempted halfway through their prompts and recompute from the start.
    engine, events = make_engine(num_kv_blocks=16, max_num_batched_tokens=16, policy="fcfs")
    prompts = [_prompt(random.Random(i).randrange(20, 30), seed=20 + i) for i in range(8)]
    requests = [EngineRequest(f"p{i}", p, SamplingParams(max_tokens=16, prompt_logprobs=2, **GREEDY))
                for i, p in enumerate(prompts)]
    out = _run(engine, requests)
    for request in requests:
        _assert_hf_scores(_only_scores(out[request.request_id]), request.prompt_token_ids,
                          hf_scores(request.prompt_token_ids), k=2)
    halfway = _preempted_mid_prefill(events, {r.request_id: r.prompt_token_ids for r in requests})
    assert any(computed > 1 for _, computed in halfway), "no request lost scored rows to a preemption"


def test_rows_scored_before_a_preemption_are_not_scored_again():
    seq = Sequence("s", list(range(10, 30)))  # 20 prompt tokens: rows 0..18 score tokens 1..19
    scores = [TokenLogprob(10, "a", None)] + [TokenLogprob(t, "a", -1.0) for t in range(11, 18)]  # rows 0..6 scored
    state = SimpleNamespace(prompt_scores=scores, seq=seq)
    other = Sequence("o", [1, 2, 3])
    plan = [ScheduledChunk(other, 0, 3), ScheduledChunk(seq, 0, 12)]  # the recompute starts over at 0
    wanted, step_rows = rows_to_score(plan, {"s": state}.get)
    assert [(w.first, w.count) for w in wanted] == [(7, 5)]
    assert step_rows == [3 + 7, 3 + 8, 3 + 9, 3 + 10, 3 + 11]
    # The chunk that ends the prompt scores up to its last token but one; the last row samples.
    scores += [TokenLogprob(t, "a", -1.0) for t in range(18, 23)]
    wanted, step_rows = rows_to_score([ScheduledChunk(seq, 12, 8)], {"s": state}.get)
    assert [(w.first, w.count) for w in wanted] == [(12, 7)] and step_rows == list(range(0, 7))


class _ScoredPrompt:
    """A prompt of a little over two full slices scored through ``score_prompts`` on a head whose every row costs
    ``row_s`` on a fake clock: the slices' sizes, the scores, and what was scored before each ``between_slices``."""

    def __init__(self, row_s: float) -> None:
        self.prompt = list(range(1, 2 * SLICE_ROWS + 12))
        self.rows = len(self.prompt) - 1
        self.row_s, self.now = row_s, 0.0
        self.hidden = torch.randn(self.rows, 8, generator=torch.Generator().manual_seed(0))
        self.head = torch.randn(8, 600, generator=torch.Generator().manual_seed(1))

    def score(self, beside_the_step: bool) -> tuple[list[TokenLogprob], list[int], list[int], Sequence]:
        seq = Sequence("s", self.prompt)
        state = SimpleNamespace(prompt_scores=[TokenLogprob(self.prompt[0], "a", None)], seq=seq,
                                request=SimpleNamespace(params=SamplingParams(prompt_logprobs=2)))
        slices: list[int] = []
        scored_before_each_call: list[int] = []

        def head_logits(h: torch.Tensor) -> torch.Tensor:
            slices.append(h.shape[0])
            self.now += self.row_s * h.shape[0]
            return torch.stack([row @ self.head for row in h])  # row by row: the same bits whatever the slice

        def between_slices() -> None:
            scored_before_each_call.append(len(state.prompt_scores) - 1)
            self.now += 1.0  # express steps in between: not the slice's own time

        score_prompts(self.hidden, [PromptRows(state, 0, self.rows)], head_logits,
                      SimpleNamespace(id_to_token_text=str), between_slices if beside_the_step else None,
                      clock=lambda: self.now)
        return state.prompt_scores, slices, scored_before_each_call, seq


def test_a_long_prompts_scores_let_a_neighbour_in_between_their_slices():
    """Scores come after the forward, outside its between-layers calls: 512 rows of them were a stretch in which
    a neighbour's short request waited for all of the step (the hostile bench's prompt_logprobs attack). Each
    call comes after the slice before it is scored: its logprobs are its rows' before the next slice begins."""
    scores, slices, scored_before_each_call, seq = _ScoredPrompt(SLICE_S / FIRST_SLICE_ROWS).score(True)
    assert set(slices[:-1]) == {FIRST_SLICE_ROWS} and sum(slices) == len(scores) - 1
    assert scored_before_each_call == [sum(slices[:i]) for i in range(len(slices))]
    assert seq.reads_prefix_cache


@pytest.mark.parametrize("slow", [False, True])
def test_beside_the_step_a_slice_lasts_about_slice_s_on_a_slow_cpu_as_on_a_fast_one(slow):
    """Slices of 32 rows beside others took 84 ms on an AVX2 Zen 1, several of its neighbours' decode steps, and
    a 128-row slice with nobody yet beside the step kept an arriving request waiting 50 ms on a Zen 4: beside
    the step each slice is sized from the last one's time, within MIN_SLICE_ROWS and SLICE_ROWS. Alone (no
    ``between_slices``) they are SLICE_ROWS. The scores are the same."""
    scored = _ScoredPrompt(SLICE_S / (MIN_SLICE_ROWS / 2) if slow else SLICE_S / 64)
    alone, alone_slices, _, _ = scored.score(False)
    beside, beside_slices, _, seq = scored.score(True)
    assert alone_slices == [SLICE_ROWS, SLICE_ROWS, scored.rows - 2 * SLICE_ROWS]
    assert beside_slices[0] == FIRST_SLICE_ROWS and sum(beside_slices) == scored.rows
    assert set(beside_slices[1:-1]) == ({MIN_SLICE_ROWS} if slow else {64})
    assert beside == alone and seq.reads_prefix_cache
