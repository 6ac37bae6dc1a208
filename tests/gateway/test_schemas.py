"""Request validation: each kind of bad input is a 4xx naming its parameter, never a 500."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.sampling import Sampling
from gateway.schemas import parse_chat, parse_completion, parse_json_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def error_of(fn, body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body)
    return e.value


def test_minimal_chat_parses_with_openai_defaults():
    r = parse_chat(CHAT)
    assert (r.kind, r.model, r.sampling.temperature, r.sampling.top_p, r.max_tokens, r.logprobs, r.stream) == (
        "chat", "m", 1.0, 1.0, None, None, False)
    assert r.messages[0].content == "hi"


def test_content_parts_are_joined_and_nulls_mean_absent():
    r = parse_chat({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}],
                    "temperature": None, "max_tokens": None})
    assert r.messages[0].content == "ab" and r.sampling.temperature == 1.0


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat({**CHAT, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7


def test_chat_logprobs_map_to_engine_logprobs():
    assert parse_chat({**CHAT, "logprobs": True}).logprobs == 0
    assert parse_chat({**CHAT, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert parse_completion({**COMPLETION, "logprobs": 2}).logprobs == 2


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": 3}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "seed": 1.5}, "seed"),
        ({**CHAT, "seed": 2**64}, "seed"),
        ({**CHAT, "stop": 5}, "stop"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "stop": ["x" * 1001]}, "stop"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "user": 7}, "user"),
        ({"messages": CHAT["messages"]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ],
)
def test_bad_chat_field_is_400_naming_the_parameter(body, param):
    e = error_of(parse_chat, body)
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": 3}, "prompt"),
        ({"model": "m", "prompt": ["a", [1]]}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 2049}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 200, "n": 11}, "n"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({**COMPLETION, "logprobs": 6}, "logprobs"),
        ({**COMPLETION, "logprobs": True}, "logprobs"),
        ({**COMPLETION, "echo": "yes"}, "echo"),
        ({**COMPLETION, "prompt": [[1, 2], []]}, "prompt[1]"),
        ({**COMPLETION, "prompt": [[1, 2], [3, -1]]}, "prompt[1]"),
        ({**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({**COMPLETION, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({**COMPLETION, "best_of": 3}, "best_of"),
    ],
)
def test_bad_completion_field_is_400_naming_the_parameter(body, param):
    e = error_of(parse_completion, body)
    assert e.status == 400 and e.param == param


def test_token_id_prompts_and_batches_of_one_are_accepted():
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt == (4, 5)


def test_list_prompts_keep_their_entries_in_order():
    texts = parse_completion({"model": "m", "prompt": ["a", "b", "c"]})
    assert (texts.prompt, texts.more_prompts) == ("a", ("b", "c"))
    ids = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "n": 2})
    assert (ids.prompt, ids.more_prompts, ids.n) == ((1, 2), ((3,),), 2)


@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)], ids=["chat", "completion"])
def test_prompt_logprobs_is_read_on_both_endpoints_and_echo_on_completions(parse, base):
    assert parse({**base, "prompt_logprobs": 3}).prompt_logprobs == 3
    assert parse(base).prompt_logprobs is None
    assert parse_completion({**COMPLETION, "echo": True}).echo is True
    assert error_of(parse_chat, {**CHAT, "echo": True}).param == "echo"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe", b"null", b'"text"'])
def test_malformed_json_is_400(raw):
    e = error_of(parse_json_body, raw)
    assert e.status == 400 and e.body()["error"]["code"] == "invalid_json"


def test_ignore_eos_is_accepted_as_vllms_extension_and_must_be_a_boolean():
    assert parse_completion({**COMPLETION, "ignore_eos": True}).ignore_eos is True
    assert parse_chat(CHAT).ignore_eos is False
    assert error_of(parse_chat, {**CHAT, "ignore_eos": "yes"}).param == "ignore_eos"


@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)], ids=["chat", "completion"])
@pytest.mark.parametrize("name, value", [
    ("functions", [{"name": "f"}]), ("reasoning_effort", "high"), ("store", True), ("mirostat", 2),
    ("typical_p", 0.9),
])
def test_an_argument_we_do_not_serve_is_400_naming_it(parse, base, name, value):
    with pytest.raises(APIError) as e:
        parse({**base, name: value})
    assert (e.value.status, e.value.param) == (400, name)
    assert e.value.code in ("unknown_parameter", "unsupported_parameter")


@pytest.mark.parametrize("name, value", [
    ("store", False), ("modalities", ["text"]), ("metadata", {"k": "v"}), ("service_tier", "auto"),
])
def test_an_unserved_argument_at_its_no_op_value_is_accepted(name, value):
    assert parse_chat({**CHAT, name: value}).model == CHAT["model"]


@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)], ids=["chat", "completion"])
def test_openai_penalties_logit_bias_and_vllms_sampling_extensions_are_read(parse, base):
    sampling = parse({**base, "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"7": -100, "12": 2.5},
                      "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 3, "min_tokens": 4}).sampling
    assert sampling == Sampling(top_k=5, min_p=0.1, presence_penalty=-1.0, frequency_penalty=0.5,
                                repetition_penalty=1.2, logit_bias=((7, -100.0), (12, 2.5)), seed=3, min_tokens=4)
    assert parse({**base, "top_k": -1, "logit_bias": None}).sampling == Sampling()  # vLLM's "off"


@pytest.mark.parametrize("name, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", "1"), ("logit_bias", {"a": 1}), ("logit_bias", {"-3": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": "x"}), ("logit_bias", [5]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5),
    ("repetition_penalty", 0), ("repetition_penalty", 3), ("min_tokens", -1), ("min_tokens", 2.5),
])
def test_a_sampling_knob_out_of_range_is_400_naming_it(name, value):
    assert error_of(parse_chat, {**CHAT, name: value}).param == name


def test_chat_template_options_are_read_and_checked():
    template = parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
                           "continue_final_message": True}).template
    assert (template.add_generation_prompt, template.continue_final_message, template.variables) == (
        False, True, {"enable_thinking": False})
    assert parse_chat(CHAT).template.add_generation_prompt is True
    assert error_of(parse_chat, {**CHAT, "chat_template_kwargs": ["x"]}).param == "chat_template_kwargs"
    reserved = error_of(parse_chat, {**CHAT, "chat_template_kwargs": {"messages": []}})
    assert reserved.param == "chat_template_kwargs" and "'messages'" in str(reserved)
    assert error_of(parse_chat, {**CHAT, "continue_final_message": True}).param == "continue_final_message"
    assert error_of(parse_completion, {**COMPLETION, "chat_template_kwargs": {}}).param == "chat_template_kwargs"


def test_stop_token_ids_are_read_as_token_ids():
    assert parse_completion({**COMPLETION, "stop_token_ids": [3, 7]}).stop_token_ids == (3, 7)
    for bad in ([-1], ["3"], 3, list(range(65))):
        assert error_of(parse_chat, {**CHAT, "stop_token_ids": bad}).param == "stop_token_ids"


def test_speculative_is_an_opt_out_boolean_for_both_endpoints():
    assert parse_chat(CHAT).speculative and parse_completion(COMPLETION).speculative
    assert not parse_chat({**CHAT, "speculative": False}).speculative
    assert not parse_completion({**COMPLETION, "speculative": False}).speculative
    assert error_of(parse_chat, {**CHAT, "speculative": "no"}).param == "speculative"
