"""vLLM's `structured_outputs` through the real `openai` client (as `extra_body`), on a tiny RANDOM
model with a 256-byte tokenizer: whatever matches is there because the grammar allowed nothing else."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.gateway.test_structured_outputs import _chat, client, live, long_context_model_dir  # noqa: F401

CHOICES = ["red", "green", "dark \"blue\"", "été"]


def _so(live, client, structured: dict, *, completion: bool = False, **kwargs):
    kwargs = {"max_tokens": 60, "extra_body": {"structured_outputs": structured}, **kwargs}
    if completion:
        return client.completions.create(model=live.engine.model_name, prompt="go", **kwargs)
    return _chat(live, client, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_choice_answers_exactly_one_of_the_strings(live, client, seed):
    out = _so(live, client, {"choice": CHOICES}, seed=seed, temperature=1.0)
    assert out.choices[0].message.content in CHOICES and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [0, 1])
def test_a_regex_answers_a_full_match_on_both_endpoints(live, client, seed):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    chat = _so(live, client, {"regex": pattern}, seed=seed, temperature=1.0).choices[0].message.content
    text = _so(live, client, {"regex": pattern}, completion=True, seed=seed, temperature=1.0).choices[0].text
    assert re.fullmatch(pattern, chat) and re.fullmatch(pattern, text)


def test_an_ebnf_grammar_and_a_json_schema_are_followed(live, client):
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for seed in range(3):
        out = _so(live, client, {"grammar": grammar}, seed=seed, temperature=1.0, max_tokens=12).choices[0]
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\([0-9](\+[0-9])*\)", out.message.content)
        else:  # cut by max_tokens: a prefix of such a sum
            assert re.fullmatch(r"\([0-9+]*", out.message.content) and "++" not in out.message.content
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    answer = _so(live, client, {"json": json.dumps(schema)}, seed=1, temperature=1.0, max_tokens=40).choices[0]
    assert answer.finish_reason == "stop" and json.loads(answer.message.content)["n"] in range(10)


@pytest.mark.parametrize(
    "structured, extra, param",
    [
        ({"regex": "[unclosed"}, {}, "structured_outputs"),
        ({"grammar": "root ::= missing_rule"}, {}, "structured_outputs"),
        ({"choice": []}, {}, "structured_outputs.choice"),
        ({"regex": "a", "choice": ["a"]}, {}, "structured_outputs"),
        ({"whitespace_pattern": " "}, {}, "structured_outputs.whitespace_pattern"),
        ({"json": "{not json"}, {}, "structured_outputs.json"),
        ({"regex": "a"}, {"response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)
def test_a_bad_structured_output_is_a_400_naming_it_and_holds_nothing(live, client, structured, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _so(live, client, structured, **extra)
    assert info.value.body["param"] == param
    assert live.engine.scheduler.num_used_blocks == 0
