"""Incremental detokenization: never half a character, stop strings cut and held back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.request import MAX_STOP_CHARS, SamplingParams

CORPUS = ["hello world", "héllo wörld", "emoji 🙂 party 🎉", "stop here END more", "ünïcödé"] * 5


@pytest.fixture(scope="module")
def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A tiny vocabulary keeps multi-byte characters split over several tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _stream(tok: Tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, [], stop)
    pieces = []
    for token_id in tok.encode(text).ids:
        pieces.append(detok.add_token(token_id))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    return pieces, detok


def test_multibyte_characters_are_never_emitted_in_halves(byte_level_tokenizer):
    text = "emoji 🙂 and ünïcödé 🎉"
    ids = byte_level_tokenizer.encode(text).ids
    assert len(ids) > len(text.split())  # the emoji really spans several tokens
    pieces, _ = _stream(byte_level_tokenizer, text)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_a_stop_string_cuts_the_text_before_it(byte_level_tokenizer):
    pieces, detok = _stream(byte_level_tokenizer, "stop here END more", stop=("END",))
    assert detok.stopped
    assert "".join(pieces) == "stop here "


def test_text_that_may_start_a_stop_string_is_held_back(byte_level_tokenizer):
    detok = IncrementalDetokenizer(byte_level_tokenizer, [], ("ENDING",))
    emitted = ""
    for token_id in byte_level_tokenizer.encode("hello END").ids:
        emitted += detok.add_token(token_id)
    assert emitted == "hello "  # "END" could still become "ENDING"
    assert detok.flush() == "END"


def test_a_stop_string_split_across_tokens_is_found(byte_level_tokenizer):
    pieces, detok = _stream(byte_level_tokenizer, "héllo wörld", stop=("ö",))
    assert detok.stopped and "".join(pieces) == "héllo w"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=40), stop=st.text(alphabet="abc", min_size=1, max_size=6))
def test_the_stop_matcher_tracks_the_longest_prefix_of_the_stop_string_the_text_ends_with(text, stop):
    matcher = StopMatcher(stop)
    for i, char in enumerate(text):
        whole = matcher.feed(char)
        seen = text[: i + 1]
        longest = max(k for k in range(len(stop) + 1) if seen.endswith(stop[:k]))
        assert matcher.matched == longest
        assert whole == seen.endswith(stop)


def test_of_stop_strings_ending_on_the_same_character_the_longest_cuts(byte_level_tokenizer):
    pieces, detok = _stream(byte_level_tokenizer, "stop here END more", stop=("D", "END"))
    assert detok.stopped and "".join(pieces) == "stop here "


def test_a_stop_string_longer_than_the_bound_is_refused():
    SamplingParams(stop=("x" * MAX_STOP_CHARS,)).validate()
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=("ok", "x" * (MAX_STOP_CHARS + 1))).validate()
