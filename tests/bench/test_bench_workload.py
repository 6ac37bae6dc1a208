"""The throughput workload is fixed by its seed, within its length ranges, and shares no prompt prefix."""

from __future__ import annotations

import pytest

from bench.common import paths
from bench.common.workload import build_workload


def encode(text: str) -> list[int]:
    return [hash(word) % 50_000 for word in text.split()]


def test_workload_is_reproducible_and_within_its_ranges():
    a = build_workload(encode, 64, (20, 400), (16, 256), seed=0)
    assert a == build_workload(encode, 64, (20, 400), (16, 256), seed=0)
    assert a != build_workload(encode, 64, (20, 400), (16, 256), seed=1)
    assert [r.index for r in a] == list(range(64))
    assert all(20 <= r.prompt_len <= 400 and 16 <= r.output_len <= 256 for r in a)


def test_prompts_start_at_distinct_offsets_so_no_two_share_a_first_block():
    requests = build_workload(encode, 64, (20, 400), (16, 256), seed=0)
    firsts = {tuple(r.prompt_token_ids[:16]) for r in requests}
    assert len(firsts) == len(requests)


def test_prompts_longer_than_the_corpus_repeat_it():
    corpus_len = len(encode(paths.PASSAGES.read_text()))
    requests = build_workload(encode, 4, (corpus_len + 50, corpus_len + 60), (16, 16), seed=0)
    assert all(r.prompt_len >= corpus_len + 50 for r in requests)


def test_more_requests_than_distinct_offsets_is_refused():
    with pytest.raises(ValueError):
        build_workload(encode, 100_000)
