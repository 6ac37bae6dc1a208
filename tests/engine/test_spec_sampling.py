"""Verifying drafts: greedy keeps exactly the argmax run; rejection sampling gives the plain sampler's
distribution at every position (chi-square over many seeds); prompt lookup drafts what followed."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.ngram import NgramIndex
from engine.request import SamplingParams
from engine.sampler import draw, filtered_probs, make_generator, sample
from engine.spec_sampling import verify_row
from tests.engine.chi_square import chi2_critical, homogeneity

VOCAB = 8


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, VOCAB, generator=g) * 1.5


def test_greedy_keeps_the_drafts_that_are_each_positions_argmax_and_then_the_argmax():
    logits = _logits(0)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0)
    assert [t.token_id for t in verify_row(logits, best[:2], params, None)] == best
    wrong = (best[1] + 1) % VOCAB
    assert [t.token_id for t in verify_row(logits, [best[0], wrong], params, None)] == best[:2]
    assert [t.token_id for t in verify_row(logits, [wrong if wrong != best[0] else (wrong + 1) % VOCAB, best[1]],
                                           params, None)] == best[:1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05)])
def test_rejection_sampling_gives_each_position_the_plain_samplers_distribution(params):
    logits = _logits(1)
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # likely enough to be kept often
    draws = 6000
    first_spec, second_spec, first_plain, second_plain = Counter(), Counter(), Counter(), Counter()
    kept = 0
    for seed in range(draws):
        run = verify_row(logits, drafts, params, make_generator(SamplingParams(seed=seed)))
        first_spec[run[0].token_id] += 1
        if run[0].token_id == drafts[0]:  # the second position is the model's only after the first draft
            kept += 1
            second_spec[run[1].token_id] += 1
        plain = sample(logits[:1], [params], [make_generator(SamplingParams(seed=10**6 + seed))])
        first_plain[plain[0].token_id] += 1
        second_plain[sample(logits[1:2], [params], [make_generator(SamplingParams(seed=2 * 10**6 + seed))])[0]
                     .token_id] += 1
    assert kept > draws // 10, "drafts rarely kept: the test does not reach the second position"
    for spec, plain in ((first_spec, first_plain), (second_spec, second_plain)):
        stat, df = homogeneity(spec, plain)
        assert df >= 1 and stat < chi2_critical(df), (spec, plain)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_drafts_drawn_from_another_distribution_give_each_position_the_plain_samplers_distribution(params):
    logits = _logits(1)
    draft_logits = logits[:2] + _logits(7)[:2]  # a draft model's q: like the model's p, not equal to it
    q = torch.stack([filtered_probs(row, params) for row in draft_logits])
    q = q / q.sum(-1, keepdim=True)
    draws = 6000
    spec, plain = [Counter(), Counter()], [Counter(), Counter()]
    rejected = 0
    for seed in range(draws):
        g = make_generator(SamplingParams(seed=seed))
        drafts = [draw(q[0], g), draw(q[1], g)]
        run = verify_row(logits, drafts, params, g, q)
        rejected += len(run) < 3
        spec[0][run[0].token_id] += 1
        if run[0].token_id == drafts[0] and len(run) > 1:  # the second position as after the first draft
            spec[1][run[1].token_id] += 1
        for i in range(2):
            plain[i][sample(logits[i:i + 1], [params], [make_generator(SamplingParams(seed=(i + 1) * 10**6 + seed))])[0]
                     .token_id] += 1
    assert rejected > draws // 10 and sum(spec[1].values()) > draws // 10, "drafts never rejected or never kept"
    for got, want in zip(spec, plain):
        stat, df = homogeneity(got, want)
        assert df >= 1 and stat < chi2_critical(df), (got, want)


def test_thehomogeneity_test_tells_a_biased_sampler_apart():
    logits = _logits(1)
    params = SamplingParams(temperature=1.0)
    plain = Counter(sample(logits[:1], [params], [make_generator(SamplingParams(seed=s))])[0].token_id
                    for s in range(6000))
    biased = Counter()
    for s in range(6000):  # keeping a draft always (a broken acceptance test) over-weights it
        biased[int(logits[0].argsort()[-2]) if s % 4 == 0 else
               sample(logits[:1], [params], [make_generator(SamplingParams(seed=s + 10**6))])[0].token_id] += 1
    stat, df = homogeneity(biased, plain)
    assert stat > chi2_critical(df)


def test_a_row_whose_draw_fails_carries_the_error_alone():
    logits = torch.full((2, VOCAB), float("nan"))
    [token] = verify_row(logits, [1], SamplingParams(temperature=1.0), make_generator(SamplingParams(seed=1)))
    assert token.error and "sampling failed" in token.error


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_run_of_the_longest_suffix():
    index = NgramIndex(min_n=1, max_n=3)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3])
    assert index.propose(3) == [7, 8, 2]  # "2 3" last came before 7 8
    index.extend([4])
    assert index.propose(2) == [5, 9]  # "2 3 4" came once, before 5 9
    index.extend([6])
    assert index.propose(2) == []  # 6 never came before
    assert NgramIndex(2, 3).propose(4) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
