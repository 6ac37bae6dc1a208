"""tiergate_common.env: one parser for every TIERGATE_* variable, and the switches the engine reads through it."""

from __future__ import annotations

import pytest

from tiergate_common.env import CPU_THREADS, DEBUG, FUSED_NORMS, PACKED_WEIGHTS, PAGED_ATTENTION, EnvError, Var, parse_bool


@pytest.mark.parametrize("word", ["1", "true", "YES", " on "])
def test_true_words_are_true_in_any_case(word):
    assert parse_bool("TIERGATE_X", word) is True


@pytest.mark.parametrize("word", ["0", "False", "no", "OFF"])
def test_false_words_are_false_in_any_case(word):
    assert parse_bool("TIERGATE_X", word) is False


def test_another_word_is_an_error_naming_the_variable():
    with pytest.raises(EnvError, match="TIERGATE_X must be true or false, not 'maybe'"):
        parse_bool("TIERGATE_X", "maybe")


def test_an_unset_or_empty_variable_is_its_default():
    assert DEBUG.get({}) is False
    assert DEBUG.get({"TIERGATE_DEBUG": " "}) is False
    assert CPU_THREADS.get({}) is None
    assert Var("SOMETHING", float, 1.5).get({}) == 1.5


def test_a_typed_variable_is_parsed_or_refused_by_name():
    assert CPU_THREADS.get({"TIERGATE_CPU_THREADS": "3"}) == 3
    with pytest.raises(EnvError, match="TIERGATE_CPU_THREADS must be a int, not 'two'"):
        CPU_THREADS.get({"TIERGATE_CPU_THREADS": "two"})


def test_switches_read_auto_and_off_in_the_boolean_words():
    assert [FUSED_NORMS.get({"TIERGATE_FUSED_NORMS": w}) for w in ("", "auto", "1", "on")] == ["auto"] * 4
    assert [PAGED_ATTENTION.get({"TIERGATE_PAGED_ATTENTION": w}) for w in ("0", "off", "No", "false")] == ["off"] * 4
    assert PACKED_WEIGHTS.get({"TIERGATE_PACKED_WEIGHTS": "oneDNN"}) == "onednn"
    with pytest.raises(EnvError, match="TIERGATE_PAGED_ATTENTION must be one of auto, off"):
        PAGED_ATTENTION.get({"TIERGATE_PAGED_ATTENTION": "onednn"})


def test_a_variable_is_read_when_asked_so_a_later_setting_applies(monkeypatch):
    monkeypatch.setenv("TIERGATE_FUSED_NORMS", "off")
    assert FUSED_NORMS.get() == "off"
    monkeypatch.setenv("TIERGATE_FUSED_NORMS", "on")
    assert FUSED_NORMS.get() == "auto"
