"""The attacks of issue #31, as request bodies the hostile bench (bench/live/hostile.py) sends one attack at a time.

Each attack is a list of requests sent with a concurrency, from a standard tenant of
its own, so its ledger rows can be counted against what it sent. Sizes are the issue's
where they fit a request body (1 MiB), scaled down where the issue's own took minutes.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Attack:
    name: str
    what: str  # one line for the report
    bodies: list[tuple[str, dict]]  # (path, body), sent in order, ``concurrency`` at a time
    concurrency: int = 1
    check: str | None = None  # a property of every 200 to verify: "tool_calls_are_json"
    stream: bool = False
    extra: dict = field(default_factory=dict)


def _words(rng: random.Random, count: int, length: int) -> list[str]:
    alphabet = string.ascii_letters + string.digits
    return ["".join(rng.choices(alphabet, k=length)) for _ in range(count)]


def _chat(content: str, max_tokens: int = 8, **extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                    "max_tokens": max_tokens, **extra}


def _deep_arrays(depth: int) -> dict:
    return json.loads('{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth)


def _large_ebnf(rng: random.Random, target_chars: int) -> str:
    rules, size, i = [], 0, 0
    while size < target_chars:
        rule = f'r{i} ::= "{"".join(rng.choices(string.ascii_lowercase, k=40))}"'
        rules.append(rule)
        size += len(rule) + 1
        i += 1
    return "root ::= " + " | ".join(f"r{k}" for k in range(i)) + "\n" + "\n".join(rules)


AMBIGUOUS_EBNF = 'root ::= y{2000} "z"\ny ::= x "a"\nx ::= x x | "a" | ""'
LONG_PROMPT_TOKENS = 1987  # the plain long prompt


def long_prompt(n: int) -> str:
    """About LONG_PROMPT_TOKENS tokens (" hello" is one token of SmolLM2's), each prompt's own from its first."""
    return f"{n}:" + " hello" * (LONG_PROMPT_TOKENS - 3)


def attacks(round_no: int = 0) -> list[Attack]:
    """The attacks of round ``round_no``: each round's bodies are its own (random strings, long prompts), so a
    later round is not served from what an earlier one left in the caches (compiled grammars, prefixes)."""
    rng = random.Random(31 + round_no)
    tool_900kb = {"type": "function", "function": {"name": "f", "description": "d " * 450_000}}
    cut_tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a", "b"]}}}]
    huge_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * 900_000})}}
    prompt_3k6 = f"Score me {round_no}:" + " hello world" * 300  # a 3.6 KB prompt of about 600 tokens
    bad = [{"temperature": "hot"}, {"n": 99}, {"max_tokens": -1}, {"top_p": 7}, {"stop": [1, 2]}]
    return [
        Attack("grammar_flood", "45 at once (limit 8 concurrent), each a choice of 1000 random 60-character strings",
               [_chat("pick one", structured_outputs={"choice": _words(rng, 1000, 60)}) for _ in range(45)],
               concurrency=45),
        Attack("huge_choice", "a choice of 1000 strings of 900 characters",
               [_chat("pick one", structured_outputs={"choice": _words(rng, 1000, 900)})]),
        Attack("deep_schema", "arrays nested 450 deep (structured_outputs) and 490 deep (response_format)",
               [_chat("list", structured_outputs={"json": _deep_arrays(450)}),
                _chat("list", response_format={"type": "json_schema", "json_schema": {
                    "name": "deep", "schema": _deep_arrays(490)}})]),
        Attack("large_ebnf", "a 290 KB EBNF grammar, three at once",
               [_chat("write", structured_outputs={"grammar": _large_ebnf(rng, 290_000)}) for _ in range(3)],
               concurrency=3),
        Attack("ambiguous_ebnf", "an ambiguous EBNF whose mask grows slower each step, 150 tokens",
               [_chat("write", max_tokens=150, structured_outputs={"grammar": AMBIGUOUS_EBNF})]),
        Attack("tools_900kb", "a 900 KB tool description with tool_choice none, four at once",
               [_chat("hi", tools=[tool_900kb], tool_choice="none") for _ in range(4)], concurrency=4),
        Attack("tool_history_900kb", "900 KB of tool-call arguments in the history, two at once",
               [("/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": [
                   {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [huge_call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}) for _ in range(2)], concurrency=2),
        Attack("prompt_logprobs_n16", "prompt_logprobs 20 with n 16 on a 3.6 KB prompt, six at once, completions "
               "and chat", [("/v1/completions", {"model": MODEL, "prompt": prompt_3k6, "max_tokens": 1, "n": 16,
                                                 "prompt_logprobs": 20}) for _ in range(6)]
               + [_chat(prompt_3k6, max_tokens=1, n=16, prompt_logprobs=20) for _ in range(6)], concurrency=6),
        Attack("tool_call_cut", "tool calls cut by max_tokens, streamed and not (no call may carry arguments "
               "that are not JSON)", [_chat("add", max_tokens=20, tools=cut_tools, tool_choice="required",
                                            stream=stream) for stream in (False, True) * 3],
               check="tool_calls_are_json"),
        Attack("refusals_400", "50 bodies refused with a 400 after authentication",
               [_chat("hi", **bad[i % len(bad)]) for i in range(50)], concurrency=5),
        Attack("long_prompt", f"a plain prompt of about {LONG_PROMPT_TOKENS} tokens, three in turn",
               [("/v1/completions", {"model": MODEL, "prompt": long_prompt(3 * round_no + i), "max_tokens": 16})
                for i in range(3)]),
    ]
