"""Sampling: greedy, filters, seeds that hold whatever else is in the batch, logprobs."""

import torch

from engine.request import SamplingParams
from engine.sampler import greedy_tokens, make_generator, sample


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax():
    logits = _logits(4)
    params = [SamplingParams(temperature=0)] * 4
    out = sample(logits, params, [make_generator(p) for p in params])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_greedy_tokens_are_argmax_s_first_of_equal_maxima_and_nan_above_all():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 0.0], [0.0, 0.0, 0.0, 0.0], [-inf] * 4,
                           [1.0, inf, inf, 0.0], [0.0, 1.0, nan, inf]])
    assert greedy_tokens(logits) == torch.argmax(logits, dim=-1).tolist() == [1, 0, 0, 0, 1, 2]
    wide = _logits(8, vocab=49152)
    wide[:, [7, 30000]] = 40.0  # two equal maxima a vector's width apart and more
    assert greedy_tokens(wide) == torch.argmax(wide, dim=-1).tolist() == [7] * 8


def test_greedy_rows_get_no_random_stream_and_sampled_rows_do():
    assert make_generator(SamplingParams(temperature=0, seed=7)) is None
    assert isinstance(make_generator(SamplingParams(temperature=0.7)), torch.Generator)


def test_top_k_of_one_is_greedy_even_when_sampling():
    logits = _logits(3, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(3)]
    out = sample(logits, params, [make_generator(p) for p in params])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = _logits(3, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(3)]
    out = sample(logits, params, [make_generator(p) for p in params])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_top_k_never_draws_outside_the_k_best():
    logits = _logits(1, vocab=100, seed=3)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=5, seed=11)
    gen = make_generator(p)
    drawn = {sample(logits, [p], [gen])[0].token_id for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    vocab = 64
    seeded = SamplingParams(temperature=1.0, seed=1234)
    row = _logits(1, vocab, seed=4)

    def draw(batch_companions: int) -> list[int]:
        gen = make_generator(seeded)
        others = [SamplingParams(temperature=0.8, seed=s) for s in range(batch_companions)]
        others_gens = [make_generator(p) for p in others]
        tokens = []
        for step in range(20):
            logits = torch.cat([_logits(batch_companions, vocab, seed=100 + step), row]) if batch_companions else row
            out = sample(logits, others + [seeded], others_gens + [gen])
            tokens.append(out[-1].token_id)
        return tokens

    assert draw(0) == draw(5) == draw(2)


def test_logprobs_report_the_chosen_token_and_sorted_alternatives():
    logits = _logits(2, seed=5)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = sample(logits, params, [make_generator(p) for p in params])
    expected = torch.log_softmax(logits[0], -1)
    assert abs(out[0].logprob - expected.max().item()) < 1e-6
    assert [tid for tid, _ in out[0].top] == torch.topk(expected, 3).indices.tolist()
    values = [lp for _, lp in out[0].top]
    assert values == sorted(values, reverse=True)
    assert out[1].logprob is None and out[1].top == ()


def test_temperatures_and_top_ps_that_vanish_in_float32_take_the_most_likely_token():
    logits = _logits(4, seed=7)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-46, seed=1),
              SamplingParams(temperature=1.0, top_p=1e-46, seed=2), SamplingParams(temperature=1.0, top_p=1e-300)]
    out = sample(logits, params, [make_generator(p) for p in params])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.error is None for t in out)


def test_a_row_whose_draw_fails_carries_the_error_and_the_other_rows_are_sampled():
    logits = _logits(3, seed=8)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.7, seed=s, logprobs=2) for s in range(3)]
    out = sample(logits, params, [make_generator(p) for p in params])
    assert out[1].error is not None
    assert out[0].error is None and out[2].error is None
    assert out[0].logprob is not None and len(out[2].top) == 2


def test_draws_follow_the_probabilities_and_never_take_a_token_of_probability_zero():
    logits = torch.full((1, 1000), float("-inf"))
    logits[0, [3, 500, 999]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0, seed=5)
    gen = make_generator(params)
    drawn = [sample(logits, [params], [gen])[0].token_id for _ in range(4000)]
    assert set(drawn) == {3, 500, 999}
    shares = [drawn.count(t) / len(drawn) for t in (3, 500, 999)]
    assert all(abs(share - want) < 0.03 for share, want in zip(shares, (0.5, 0.3, 0.2))), shares
