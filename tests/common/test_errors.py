"""tiergate_common.errors: the one-line summary logs and the CLI give of an exception."""

from __future__ import annotations

from tiergate_common.errors import first_line


def test_a_long_message_gives_its_first_line():
    error = RuntimeError("  connection refused\n[SQL: INSERT INTO usage_ledger ...]\n(Background: https://sqlalche.me)")
    assert first_line(error) == "connection refused"


def test_an_exception_without_a_message_gives_its_class_name():
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line(ValueError("   \n ")) == "ValueError"
