"""The load generator's pure parts: arrivals, Zipf popularity, traces, plans and per-tier aggregation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.common.stats import percentile
from bench.load.aggregate import RequestResult, Slo, tier_report
from bench.load.arrivals import poisson_arrivals
from bench.load.plan import PromptTexts, Tenant, synthetic_plan, trace_plan
from bench.load.popularity import ZipfSampler, zipf_weights
from bench.load.trace import TraceRecord, read_trace, write_trace

TENANTS = [Tenant("acme", "premium", "k1"), Tenant("bob", "standard", "k2"), Tenant("cid", "standard", "k3")]


def test_poisson_arrivals_start_at_zero_increase_and_match_the_rate():
    times = poisson_arrivals(4.0, 4000, seed=1)
    assert times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.05)


def test_poisson_arrivals_are_reproducible_from_the_seed():
    assert poisson_arrivals(2.0, 20, seed=3) == poisson_arrivals(2.0, 20, seed=3)
    assert poisson_arrivals(2.0, 20, seed=3) != poisson_arrivals(2.0, 20, seed=4)


def test_poisson_arrivals_reject_a_non_positive_rate():
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 5)


def test_zipf_weights_fall_as_one_over_rank():
    w = zipf_weights(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0)
    assert w[0] / w[3] == pytest.approx(4.0)


def test_zipf_sampler_draws_the_top_adapter_most_often():
    sampler = ZipfSampler(["a", "b", "c", "d"], exponent=1.0, seed=0)
    draws = [sampler.sample() for _ in range(4000)]
    shares = [draws.count(x) / len(draws) for x in "abcd"]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] == pytest.approx(zipf_weights(4, 1.0)[0], abs=0.03)


def test_trace_round_trip_sorts_and_shifts_to_zero(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRecord(12.5, "bob", None, 30, 8), TraceRecord(10.0, "acme", "fr", 100, 20)])
    records = read_trace(path)
    assert [r.tenant for r in records] == ["acme", "bob"]
    assert [r.timestamp for r in records] == [0.0, 2.5]
    assert records[0].adapter == "fr" and records[1].adapter is None


@pytest.mark.parametrize("line", ['{"timestamp": 1, "tenant": "a"}', "not json",
                                  '{"timestamp": 1, "tenant": "a", "prompt_tokens": 0, "output_tokens": 3}'])
def test_a_bad_trace_line_is_a_clear_error_naming_the_line(tmp_path, line):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}) + "\n" + line)
    with pytest.raises(ValueError, match="line 2"):
        read_trace(path)


def test_trace_plan_keeps_times_adapters_and_lengths():
    records = [TraceRecord(0.0, "acme", "fr", 100, 20), TraceRecord(2.5, "bob", None, 30, 8)]
    plan = trace_plan(records, TENANTS, "base")
    assert [(p.send_at, p.tenant.key, p.model, p.prompt_tokens, p.output_tokens) for p in plan] == [
        (0.0, "k1", "fr", 100, 20), (2.5, "k2", "base", 30, 8)]


def test_trace_plan_refuses_a_tenant_without_a_key():
    with pytest.raises(ValueError, match="zed"):
        trace_plan([TraceRecord(0.0, "zed", None, 5, 5)], TENANTS, "base")


def test_synthetic_plan_follows_tier_share_and_length_ranges():
    plan = synthetic_plan(2000, TENANTS, {"premium": 0.25, "standard": 0.75}, "base",
                          adapters=["a", "b"], adapter_fraction=0.5, prompt_len_range=(20, 40),
                          output_len_range=(5, 9), seed=0)
    premium = sum(p.tenant.tier == "premium" for p in plan) / len(plan)
    assert premium == pytest.approx(0.25, abs=0.03)
    assert sum(p.model != "base" for p in plan) / len(plan) == pytest.approx(0.5, abs=0.04)
    assert all(20 <= p.prompt_tokens <= 40 and 5 <= p.output_tokens <= 9 for p in plan)
    assert {p.tenant.name for p in plan if p.tenant.tier == "standard"} == {"bob", "cid"}


def test_synthetic_plan_needs_a_key_for_every_tier_with_a_share():
    with pytest.raises(ValueError, match="gold"):
        synthetic_plan(3, TENANTS, {"gold": 1.0}, "base")


def test_prompt_texts_without_a_tokenizer_have_the_asked_word_count():
    texts = PromptTexts("one two three four five")
    assert len(texts.text(12, index=0).split()) == 12
    assert texts.text(3, index=0) != texts.text(3, index=1)


def test_prompt_texts_share_no_prefix_past_the_corpus_length():
    words = PromptTexts("one two three four five")
    assert len({tuple(words.text(6, index=i).split()[:2]) for i in range(60)}) == 60
    assert all(len(words.text(6, index=i).split()) == 6 for i in range(60))
    as_bytes = PromptTexts("abcdefghij", encode=lambda s: list(s.encode()), decode=lambda ids: bytes(ids).decode())
    texts = [as_bytes.text(12, index=i) for i in range(100)]
    assert len({t[:5] for t in texts}) == 100 and {len(t) for t in texts} == {12}


def _result(tier, ttft, e2e, tokens, status=200, code=None):
    return RequestResult(0, tier, "t", "base", 10, 0.0, status, code, ttft, e2e, tokens)


def test_tier_report_counts_percentiles_goodput_and_429s_per_tier():
    results = [_result("premium", 0.1 * i, 0.1 * i + 1.0, 11) for i in range(1, 11)]
    results += [_result("premium", None, None, 0, 429, "slo"), _result("standard", None, None, 0, 429, "rpm"),
                _result("standard", None, None, 0, 429, "rpm"), _result("standard", 2.0, 3.0, 2)]
    report = tier_report(results, duration_s=10.0, slos={"premium": Slo(ttft_s=0.5, tpot_s=0.2)})
    premium = report["premium"]
    assert premium["requests"] == 11 and premium["ok"] == 10
    assert premium["rejected_429"] == {"slo": 1}
    assert premium["ttft_s"]["p50"] == pytest.approx(percentile([0.1 * i for i in range(1, 11)], 50))
    assert premium["tpot_s"]["p99"] == pytest.approx(0.1)
    assert premium["goodput_requests"] == 5  # ttft 0.1 .. 0.5
    assert premium["goodput_fraction"] == pytest.approx(5 / 11)
    assert premium["output_tokens_per_s"] == pytest.approx(11.0)
    standard = report["standard"]
    assert standard["rejected_429"] == {"rpm": 2}
    assert standard["goodput_requests"] == 1  # no SLO given: every completed request counts


def test_tier_report_pools_every_gap_of_the_completed_requests():
    fast, slow = _result("premium", 0.1, 1.0, 4), _result("premium", 0.1, 2.0, 3)
    refused = _result("premium", None, None, 0, 429, "slo")
    fast.gaps_s, slow.gaps_s, refused.gaps_s = [0.05, 0.05, 0.06], [0.9, 1.0], [5.0]
    gaps = tier_report([fast, slow, refused], duration_s=10.0, slos={})["premium"]["inter_token_s"]
    assert gaps["p50"] == pytest.approx(0.06) and gaps["p99"] == pytest.approx(percentile([0.05, 0.05, 0.06, 0.9, 1.0], 99))


def test_percentile_interpolates_and_handles_no_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 99) is None
