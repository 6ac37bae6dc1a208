"""Grammar-constrained decoding: what a request's output must match, compiling it, and the per-step token mask.

xgrammar (the library vLLM, SGLang and TensorRT-LLM use) compiles a JSON
schema, a regex, an EBNF grammar or a structural tag against the model's
vocabulary; each request gets a matcher: before sampling, the matcher fills a
bitmask of the tokens its grammar allows next, the mask sets the rest of its
logits row to -inf, and the sampled token advances the matcher.

Compiles are bounded and run off every loop (engine/grammar_compiler.py); a mask
that takes longer than its budget ends its request alone (:func:`mask_logits`).
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass

import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


# Free whitespace is bounded so a model cannot stall inside a grammar on an
# endless run of spaces; deep enough for indented output of nested objects.
MAX_WHITESPACE_RUN = 12
# JSON nesting (objects and arrays) a schema may have: deeper ones are refused before anything
# walks them recursively; xgrammar's compile time grows steeply with depth.
MAX_SCHEMA_DEPTH = 64
# The string length limits (minLength, maxLength) one schema may write out, in characters: each is a
# state of the compiled grammar (see _length_pattern), so they bound its compile's memory; its time is
# bounded by the compile budget before this.
MAX_LENGTH_LIMITS = 4096
GRAMMAR_KINDS = ("json_schema", "json_object", "structural_tag", "regex", "choice", "ebnf")
# xgrammar's C++ errors start with "[time] /path/file.cc:line: ".
_CPP_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar the library cannot compile; the message says why, worded for a client."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    ``kind``: ``json_schema`` (``source`` is the schema as JSON text; ``strict``
    forbids properties the schema does not name), ``json_object`` (any JSON
    object; ``source`` unused), ``structural_tag`` (``source`` is an xgrammar
    structural tag as JSON text, e.g. free text with constrained tool calls),
    ``regex`` (``source`` is the pattern), ``choice`` (``source`` is a JSON
    list of the strings allowed, exactly one of which is the output) and
    ``ebnf`` (``source`` is a grammar in xgrammar's EBNF, rooted at ``root``).
    """

    kind: str
    source: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, not {self.kind!r}")


def compile_spec(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """``spec`` compiled by ``compiler``; :class:`GrammarError` if it cannot compile."""
    try:
        return _compile(compiler, spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # RecursionError included
        raise GrammarError(_clean_error(exc)) from None


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    with warnings.catch_warnings():  # a tokenizer without EOS is fine: see GrammarMatcher
        warnings.simplefilter("ignore")
        return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)


def _compile(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    if spec.kind == "structural_tag":
        tag = _well_formed_tag(json.loads(spec.source), [MAX_LENGTH_LIMITS])
        return compiler.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.source)
    if spec.kind == "choice":
        # JSON's string escapes are EBNF's, so each choice becomes one quoted literal.
        literals = (json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.source))
        return compiler.compile_grammar("root ::= " + " | ".join(literals))
    if spec.kind == "json_object":
        schema, strict = '{"type": "object"}', False
    else:
        schema = json.dumps(well_formed_strings(json.loads(spec.source)), ensure_ascii=False)
        strict = spec.strict
    return compiler.compile_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE_RUN, strict_mode=strict
    )


# One character of a JSON string as written, as a regex (xgrammar matches a pattern against the
# string's raw text): printable ASCII but the quote and backslash, which come only escaped, or a
# well-formed UTF-8 character with no control characters. Each class stays inside one UTF-8 length
# because xgrammar's byte automaton accepts overlong and surrogate sequences for classes that cross
# those boundaries. The 4-byte range is written as the characters themselves, as its regex has no
# escape for them.
_JSON_STRING_CHAR = (
    '([ !#-\\[\\]-~]|\\\\["\\\\/bfnrt]|'
    "[\\u00a0-\\u07ff]|[\\u0800-\\ud7ff]|[\\ue000-\\uffff]|[" + chr(0x10000) + "-" + chr(0x10FFFF) + "])"
)


def well_formed_strings(schema: object, budget: list[int] | None = None) -> object:
    """The schema with string length limits written as a pattern of well-formed characters.

    xgrammar 0.2.8 compiles ``minLength``/``maxLength`` into a character class that lets raw
    control characters and malformed UTF-8 into the string, which is not valid JSON.
    :class:`GrammarError` for a schema nested deeper than ``MAX_SCHEMA_DEPTH`` (measured without recursion),
    for length limits that are not whole numbers from 0 up, and for limits adding up past ``MAX_LENGTH_LIMITS``
    (``budget``: the characters left to write, shared by the schemas of one grammar; a fresh count if None).
    """
    check_schema_depth(schema)
    return _well_formed(schema, [MAX_LENGTH_LIMITS] if budget is None else budget)


def check_schema_depth(schema: object) -> None:
    """:class:`GrammarError` for a schema nested deeper than ``MAX_SCHEMA_DEPTH``, measured without recursion, so
    that nothing walks it recursively first."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")


def _well_formed_tag(node: object, budget: list[int]) -> object:
    """A structural tag (tool calls) with each JSON schema in it made well formed, their limits counted together."""
    if isinstance(node, list):
        return [_well_formed_tag(item, budget) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": well_formed_strings(node["json_schema"], budget)}
    return {key: _well_formed_tag(value, budget) for key, value in node.items()}


def nesting_depth(value: object, stop_after: int) -> int:
    """How deeply lists and dicts nest in ``value`` (a scalar: 0), counted up to ``stop_after + 1``;
    iterative, so any depth is measured in time linear in the size."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth > stop_after:
            return depth
        stack.extend((child, depth + 1) for child in item)
    return deepest


def _well_formed(schema: object, budget: list[int]) -> object:
    if isinstance(schema, list):
        return [_well_formed(item, budget) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _well_formed(value, budget) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = _length_pattern(low, high, budget)
    return out


def _length_pattern(low: object, high: object, budget: list[int]) -> str:
    """A pattern of ``low`` to ``high`` (None: any number of) JSON string characters, written out one
    position at a time (``high - low`` nested optional groups), not as a counted repetition: xgrammar
    checks a counted repetition against the vocabulary at every step (over 100 ms a token for
    ``{0,200}`` on a 49k vocabulary), on the engine thread that every request's step waits for, while
    positions written out are masks it computes at compile time, which is budgeted, billed to the
    sender and cached (bench/RESULTS.md). ``budget`` holds the positions the schema may still write."""
    for name, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise GrammarError(f"{name} must be a whole number from 0 up, not {value!r}")
    if high is not None and high < low:
        raise GrammarError(f"minLength {low} is greater than maxLength {high}")
    budget[0] -= low if high is None else high
    if budget[0] < 0:
        raise GrammarError(f"the schema's string length limits add up to more than {MAX_LENGTH_LIMITS} characters")
    if high is None:
        return "^" + _JSON_STRING_CHAR * low + _JSON_STRING_CHAR + "*$"
    optional = high - low
    return "^" + _JSON_STRING_CHAR * low + ("(?:" + _JSON_STRING_CHAR) * optional + ")?" * optional + "$"


def _clean_error(exc: BaseException) -> str:
    lines = [_CPP_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarMatcher:
    """One request's position in its grammar. Lives as long as the request, preemptions included:
    a preempted sequence keeps its output tokens and only recomputes their KV, so the tokens this
    matcher accepted are still exactly the sequence's output."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size_if_no_stop_token: int | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size_if_no_stop_token
        self._at_dead_end = False
        self.num_accepted = 0
        self.last_accept_s = 0.0  # CPU seconds the last accept() took

    def accept(self, token_id: int) -> bool:
        started = time.thread_time()
        ok = self._matcher.accept_token(token_id)
        # An ambiguous grammar's advance grows slower with its output: mask_logits weighs it with the mask.
        self.last_accept_s = time.thread_time() - started
        self.num_accepted += ok
        if ok and self._vocab_size is not None and self._matcher.is_completed():
            # Without a stop token to sample, the grammar ends where no token may follow
            # (a closed JSON value), not where it merely could (free text of `auto` tools).
            bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
            self._matcher.fill_next_token_bitmask(bitmask)
            self._at_dead_end = not bool(bitmask.any())
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (drafts walked through for their masks, engine/speculative.py)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self._at_dead_end = False  # no draft is taken past the end of its grammar

    @property
    def is_terminated(self) -> bool:
        return self._at_dead_end or self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None], budget_s: float | None = None
                ) -> list[int]:
    """Set, in place, the logits of tokens each row's grammar forbids to -inf; rows without one are untouched.

    Returns the rows whose grammar took longer than ``budget_s`` of this thread's CPU time for its
    step (accepting the last token and filling this mask; CPU time, so that a busy machine does not
    end a request for the time others took): their masks are still applied, but their requests must
    end, because an ambiguous grammar's work grows with its output and would stall every request of
    the step. That work grows gradually, so a row ends at about its budget.

    The packed bitmask is widened through a byte lookup table (each byte -> 8 biases of 0 or -inf)
    and added to the grammar rows in one batched op: xgrammar's CPU kernel walks the mask bit by
    bit and cost more than filling it (bench/RESULTS.md, structured outputs).
    """
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return []
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    over_budget = []
    for i, row in enumerate(rows):
        started = time.thread_time()
        matchers[row].fill_mask(bitmask, i)
        if budget_s is not None and time.thread_time() - started + matchers[row].last_accept_s > budget_s:
            over_budget.append(row)
    table = _BYTE_BIAS.to(device=logits.device, dtype=logits.dtype)
    # Little-endian int32 words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit first.
    byte_ids = bitmask.view(torch.uint8).to(device=logits.device, dtype=torch.int32)
    bias = torch.nn.functional.embedding(byte_ids, table).view(len(rows), -1)[:, :vocab]
    with torch.inference_mode():  # the runner's logits are inference tensors
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
    return over_budget


# Row v: the bias of the 8 tokens of a mask byte of value v (bit i set: token i allowed).
_BYTE_BIAS = torch.tensor([[0.0 if value >> bit & 1 else float("-inf") for bit in range(8)] for value in range(256)])
