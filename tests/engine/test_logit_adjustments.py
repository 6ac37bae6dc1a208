"""Penalties, logit_bias and min_p: each request's own, matching OpenAI's and HF's definitions, and
never touching the other rows of its batch."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.logit_adjustments import adjust_logits_
from engine.request import EngineRequest, SamplingParams
from engine.sampler import make_generator, sample


def _logits(rows: int, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_presence_and_frequency_penalties_follow_openais_definition_over_the_output():
    logits = _logits(1)
    before = logits.clone()
    output = [3, 3, 3, 7]
    adjust_logits_(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [None], [output])
    expected = before.clone()
    for token in set(output):  # mu[j] - count * frequency - (count > 0) * presence
        expected[0, token] -= output.count(token) * 0.25 + 0.5
    torch.testing.assert_close(logits, expected)  # the prompt is not read


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    adjust_logits_(logits, [SamplingParams(repetition_penalty=2.0)], [torch.tensor([0, 1])], [[1, 3]])
    torch.testing.assert_close(logits, torch.tensor([[1.0, -4.0, 2.0, -4.0, 1.0]]))


def test_logit_bias_adds_to_its_tokens_and_a_token_named_twice_gets_both():
    logits = torch.zeros(1, 10)
    adjust_logits_(logits, [SamplingParams(logit_bias=((4, 100.0), (2, -5.0), (2, -1.0)))], [None], [[]])
    assert logits[0, 4] == 100 and logits[0, 2] == -6 and logits[0].abs().sum() == 106


def test_one_rows_adjustments_leave_the_other_rows_of_the_batch_alone():
    logits = _logits(3, seed=1)
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.9, presence_penalty=2.0, frequency_penalty=2.0,
                                               logit_bias=((0, 100.0),)), SamplingParams()]
    adjust_logits_(logits, params, [None, torch.tensor([1, 2]), None], [[5, 5], [5, 5], [5, 5]])
    torch.testing.assert_close(logits[[0, 2]], before[[0, 2]])
    assert not torch.equal(logits[1], before[1])


def test_min_p_never_draws_a_token_below_its_share_of_the_likeliest():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4))
    probs = torch.softmax(logits[0], -1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    assert 1 < len(allowed) < 30
    drawn = set()
    for seed in range(200):
        params = [SamplingParams(temperature=1.0, min_p=0.2, seed=seed)]
        drawn.add(sample(logits, params, [make_generator(params[0])])[0].token_id)
    assert drawn <= allowed and len(drawn) > 1


def _run(engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    async def run():
        streams = [engine.submit(r) for r in requests]

        async def tokens(stream):
            return [t for d in [d async for d in stream] for t in d.token_ids]

        return await asyncio.gather(*(tokens(s) for s in streams))

    return {r.request_id: out for r, out in zip(requests, asyncio.run(run()))}


def test_greedy_with_a_repetition_penalty_gives_hfs_tokens_and_its_batch_neighbour_plain_greedy(
        make_engine, model_dir, hf_greedy):
    engine, _ = make_engine()
    prompt, neighbour = list(range(5, 17)), list(range(30, 41))
    penalised = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    out = _run(engine, [EngineRequest("penalised", prompt, penalised),
                        EngineRequest("neighbour", neighbour, SamplingParams(max_tokens=12, temperature=0,
                                                                             ignore_eos=True))])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out["penalised"] == expected
    assert expected != hf_greedy(prompt, 12), "the penalty changes nothing on this prompt: the test cannot fail"
    assert out["neighbour"] == hf_greedy(neighbour, 12)


@pytest.mark.parametrize("token", [3, 77])
def test_a_large_logit_bias_forces_its_token_through_the_engine(make_engine, token):
    engine, _ = make_engine()
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True, logit_bias=((token, 100.0),))
    assert _run(engine, [EngineRequest("biased", list(range(5, 15)), params)])["biased"] == [token] * 4


def test_min_tokens_bans_eos_and_stop_tokens_until_reached_and_then_lifts_the_ban():
    logits = torch.zeros(2, 10)
    params = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    adjust_logits_(logits, [params, params], [None, None], [[1], [1, 2]], eos_token_ids=(2,))
    assert logits[0, 2] == logits[0, 5] == float("-inf") and logits[0].isfinite().sum() == 8
    assert logits[1].isfinite().all()  # two tokens made: the third may end it


def test_min_tokens_holds_a_stop_string_until_reached(make_byte_engine):
    """A model forced to write 'x' every token, with the stop string 'x': it ends at once, or with
    min_tokens 3 at the third token, its text the two x's before the stop string."""
    engine, _ = make_byte_engine()
    x = engine.tokenizer.encode("x", add_special_tokens=False)[0]

    def run(min_tokens: int) -> tuple[int, str, str]:
        params = SamplingParams(max_tokens=10, temperature=0, stop=("x",), min_tokens=min_tokens,
                                logit_bias=((x, 100.0),))

        async def go():
            return [d async for d in engine.submit(EngineRequest(f"m{min_tokens}", [1, 2, 3], params))]

        deltas = asyncio.run(go())
        return sum(len(d.token_ids) for d in deltas), "".join(d.text for d in deltas), deltas[-1].finish_reason

    assert run(0) == (1, "", "stop")
    assert run(3) == (3, "xx", "stop")
