"""`tiergate budgets` and `tiergate prices`: they set and show what they say, and refuse bad input in one line."""

from __future__ import annotations

from datetime import timedelta

import pytest

from billing.models import utcnow
from tests.gateway.test_cli import tg  # noqa: F401 (the CLI runner fixture)


@pytest.fixture
def acme(tg):  # noqa: F811
    assert tg("tenants", "create", "acme", "--tier", "premium")[0] == 0
    return tg


def test_budgets_set_list_and_delete(acme):
    code, out, _ = acme("budgets", "set", "acme", "--usd", "12.5", "--period", "7d", "--timezone", "Asia/Tokyo",
                        "--soft", "0.5")
    assert code == 0 and "12.5 usd per 7d (Asia/Tokyo), warning at 50%" in out
    assert acme("budgets", "set", "acme", "--tokens", "1000")[0] == 0
    code, out, _ = acme("budgets", "list")
    header, *rows = out.strip().splitlines()
    assert header.split()[:5] == ["TENANT", "UNIT", "LIMIT", "SPENT", "LEFT"]
    assert [r.split()[:8] for r in rows] == [["acme", "tokens", "1000", "0", "1000", "month", "UTC", "0.8"],
                                             ["acme", "usd", "12.5", "0", "12.5", "7d", "Asia/Tokyo", "0.5"]]
    assert acme("budgets", "delete", "acme", "--unit", "usd")[0] == 0
    assert len(acme("budgets", "list", "acme")[1].strip().splitlines()) == 2


def test_prices_set_takes_effect_shortly_and_lists_past_and_scheduled(acme):
    later = (utcnow() + timedelta(days=2)).date().isoformat()
    code, out, _ = acme("prices", "set", "premium", "--per-gpu-second", "0.002", "--per-million-prompt-tokens", "0.5",
                        "--per-million-completion-tokens", "1.5")
    assert code == 0 and "0.002 per GPU-second" in out
    assert acme("prices", "set", "premium", "--per-gpu-second", "0.004", "--per-million-prompt-tokens", "1",
                "--per-million-completion-tokens", "3", "--from", later)[0] == 0
    rows = acme("prices", "list")[1].strip().splitlines()[1:]
    assert [r.split()[2] for r in rows] == ["0.002", "0.004"] and rows[1].split()[1].startswith(later)


@pytest.mark.parametrize("argv, message", [
    (("budgets", "set", "acme", "--tokens", "10", "--usd", "1"), "not allowed with argument"),
    (("budgets", "set", "acme"), "one of the arguments"),
    (("budgets", "set", "acme", "--tokens", "-5"), "positive integer"),
    (("budgets", "set", "acme", "--usd", "5", "--soft", "2"), "soft must be"),
    (("budgets", "set", "acme", "--usd", "5", "--period", "month2"), "period must be"),
    (("budgets", "set", "acme", "--usd", "5", "--timezone", "Nowhere/Land"), "unknown time zone"),
    (("budgets", "set", "ghost", "--usd", "5"), "unknown tenant"),
    (("budgets", "delete", "acme", "--unit", "usd"), "has no usd budget"),
    (("prices", "set", "gold", "--per-gpu-second", "1", "--per-million-prompt-tokens", "1",
      "--per-million-completion-tokens", "1"), "tier must be"),
    (("prices", "set", "premium", "--per-gpu-second", "-1", "--per-million-prompt-tokens", "1",
      "--per-million-completion-tokens", "1"), "zero or more"),
    (("prices", "set", "premium", "--per-gpu-second", "1", "--per-million-prompt-tokens", "1",
      "--per-million-completion-tokens", "1", "--from", "2020-01-01"), "past"),
])
def test_bad_budget_and_price_commands_fail_in_one_line(acme, argv, message):
    code, _, err = acme(*argv)
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1
