"""`tiergate serve --speculative draft --draft-model DIR`: wrong flag combinations and a draft model with
another vocabulary are refused at start with one line and a non-zero exit; the flags reach the engine."""

from __future__ import annotations

import pytest

from gateway.cli import main
from tests.engine.conftest import write_tiny_tokenizer
from tests.tiny_llama import write_byte_llama


def _serve(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ("--draft-model", "/some/dir"),
    ("--speculative", "draft"),
    ("--speculative", "ngram", "--draft-model", "/some/dir"),
    ("--draft-kv-blocks", "64"),
    ("--speculative", "draft", "--draft-model", "/some/dir", "--draft-kv-blocks", "0"),
])
def test_a_wrong_draft_flag_combination_is_one_line_and_a_non_zero_exit(monkeypatch, capsys, argv):
    monkeypatch.delenv("TIERGATE_SPECULATIVE", raising=False)
    code, err = _serve(capsys, *argv)
    assert code != 0
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_draft_model_with_another_vocabulary_stops_serve_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TIERGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    base = write_byte_llama(tmp_path / "base")
    other = write_byte_llama(tmp_path / "other")
    write_tiny_tokenizer(other)
    code, err = _serve(capsys, "--model", f"dummy:{base}", "--speculative", "draft",
                       "--draft-model", f"dummy:{other}", "--kv-cache-tokens", "256")
    assert code == 1
    # serve logs JSON lines while it loads; what it says of the failure is one line, no traceback.
    said = [line for line in err.strip().splitlines() if not line.startswith("{")]
    assert len(said) == 1 and "vocabulary differs" in said[0] and "Traceback" not in err, err


def test_the_draft_flags_reach_the_engine_config():
    from gateway.server import engine_config
    from gateway.settings import load_settings

    settings = load_settings({"speculative": "draft", "draft_model": "/models/small", "draft_kv_blocks": 32},
                             environ={"TIERGATE_NUM_SPECULATIVE_TOKENS": "3"})
    config = engine_config(settings)
    assert (config.speculative, config.draft_model, config.draft_num_kv_blocks, config.num_speculative_tokens) == (
        "draft", "/models/small", 32, 3)
