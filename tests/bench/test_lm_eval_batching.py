"""lm-evaluation-harness (the bench extras) against a live server: batch size 8 scores as batch size 1 does."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from billing.models import UsageEntry

from bench.common import machine
from bench.live.lm_eval_batching import evaluate, largest_difference, render_markdown, write_task
from tests.gateway.conftest import database_url, make_engine, serve, tiny_model_dir  # noqa: F401 (fixtures)


@pytest.mark.bench_peers
def test_local_completions_at_batch_size_8_gives_the_loglikelihoods_of_batch_size_1(serve, tmp_path):
    live = serve()
    key = live.add_tenant("eval", "standard", rpm=100_000, tpm=100_000_000, max_concurrent=8)
    task_dir = write_task(tmp_path, questions=6)
    one = evaluate(live.url, live.engine.model_name, key, task_dir, batch_size=1)
    singles = _requests(live)
    eight = evaluate(live.url, live.engine.model_name, key, task_dir, batch_size=8)
    # 6 questions x 4 choices: 24 requests of one prompt, then 3 of eight prompts, one ledger row each.
    assert (singles, _requests(live) - singles) == (24, 3)
    assert [len(q) for q in one["loglikelihoods"]] == [4] * 6
    assert largest_difference(one["loglikelihoods"], eight["loglikelihoods"]) < 1e-4
    assert one["acc"] == eight["acc"]


def _requests(live) -> int:
    with live.db.connect() as c:
        return c.execute(select(func.count()).select_from(UsageEntry)
                         .where(UsageEntry.request_id.like("cmpl-%"))).scalar_one()


def test_the_report_gives_each_batch_sizes_speedup_and_largest_difference():
    result = {"machine": machine.describe(), "model": "m", "questions": 4, "choices": 4,
              "rounds": 2, "reference_batch_size": 1,
              "batch_sizes": {"1": {"wall_s": 10.0, "rounds_wall_s": [10.0, 10.0], "acc": 0.5, "max_abs_diff": 0.0},
                              "8": {"wall_s": 4.0, "rounds_wall_s": [4.0, 4.1], "acc": 0.5, "max_abs_diff": 2e-6}}}
    table = render_markdown(result)
    assert "| 8 | 4.0 | 4.0, 4.1 | 2.50x | 0.500 | 2.0e-06 |" in table


def test_the_local_task_is_a_quiz_whose_answer_is_among_its_choices(tmp_path):
    import json

    write_task(tmp_path, questions=5)
    rows = [json.loads(line) for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
    for row in rows:
        a, b = (int(w.rstrip("?")) for w in row["question"].split() if w.rstrip("?").isdigit())
        assert row["choices"][row["answer"]] == f" {a + b}" and len(set(row["choices"])) == 4
