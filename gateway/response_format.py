"""The grammar a request's output must match: OpenAI's `response_format` (text, JSON mode, JSON
Schema) or vLLM's `structured_outputs` (a JSON schema, a regex, a choice of strings, an EBNF grammar
or JSON mode), as the spec the engine decodes under.

A grammar's size is bounded here, at parse time and in time linear in the
body (no recursion: a schema nested past Python's limit is a 400 like any
other), because a compile's cost grows with it; the compile itself, after the
tenant's limits, is gateway/grammar_budget.py's.
"""

from __future__ import annotations

import json
from typing import Any

from engine.grammar import MAX_SCHEMA_DEPTH, GrammarError, GrammarSpec, nesting_depth
from gateway.errors import invalid_param

FORMAT_TYPES = ("text", "json_object", "json_schema")
# Bytes of a grammar's source (UTF-8), by kind: past these a compile takes seconds to minutes.
MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema, or all of a request's tool schemas
MAX_REGEX_BYTES = 16 * 1024
MAX_EBNF_BYTES = 32 * 1024
MAX_CHOICE_BYTES = 64 * 1024  # all choices together
_MAX_BYTES = {"json_schema": MAX_SCHEMA_BYTES, "structural_tag": MAX_SCHEMA_BYTES, "regex": MAX_REGEX_BYTES,
              "ebnf": MAX_EBNF_BYTES, "choice": MAX_CHOICE_BYTES, "json_object": MAX_SCHEMA_BYTES}
# A structural tag wraps each tool's schema this many levels deeper than the schema itself.
_TAG_WRAPPING_DEPTH = 6


def parse_response_format(body: dict[str, Any]) -> GrammarSpec | None:
    """The grammar a request's ``response_format`` asks for; None for free text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_param("response_format", "Invalid type for 'response_format': expected an object.",
                            "invalid_type")
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise invalid_param("response_format.type", f"Invalid value for 'response_format.type': {kind!r}; "
                            f"expected one of {', '.join(FORMAT_TYPES)}.", "invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_param("response_format.json_schema", "Missing required parameter: "
                            "'response_format.json_schema' (an object with 'name' and 'schema').",
                            "missing_required_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_param("response_format.json_schema.name", "Missing required parameter: "
                            "'response_format.json_schema.name'.", "missing_required_parameter")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise invalid_param("response_format.json_schema.schema", "Invalid type for "
                            "'response_format.json_schema.schema': expected a JSON Schema object.", "invalid_type")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param("response_format.json_schema.strict", "Invalid type for "
                            "'response_format.json_schema.strict': expected a boolean.", "invalid_type")
    return bounded(GrammarSpec("json_schema", _schema_text(schema, "response_format"), strict=bool(strict)),
                   "response_format")


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1000


def parse_output_grammar(body: dict[str, Any]) -> tuple[GrammarSpec | None, str]:
    """The grammar of ``response_format`` or ``structured_outputs`` (one of them at most), and the
    parameter it came from."""
    from_format, from_structured = parse_response_format(body), parse_structured_outputs(body)
    if from_format is not None and from_structured is not None:
        raise invalid_param("structured_outputs", "'structured_outputs' cannot be combined with a "
                            "'response_format' other than text.", "invalid_value")
    if from_structured is not None:
        return from_structured, "structured_outputs"
    return from_format, "response_format"


def tool_grammar(tools) -> GrammarSpec | None:
    """The call grammar of a request's ``tools`` (gateway/tools.py), bounded as a schema is; 400 naming ``tools``."""
    try:
        spec = tools.grammar()
    except GrammarError as e:  # a parameters schema nested too deeply
        raise invalid_param("tools", f"Invalid schema for 'tools': {e}.", "invalid_value") from None
    return None if spec is None else bounded(spec, "tools")


def bounded(spec: GrammarSpec, param: str) -> GrammarSpec:
    """``spec`` if its source is within the bounds of its kind; else a 400 naming ``param``."""
    limit = _MAX_BYTES[spec.kind]
    size = len(spec.source.encode())
    if size > limit:
        what = "choices" if spec.kind == "choice" else spec.kind.replace("_", " ")
        raise invalid_param(param, f"Invalid value for '{param}': its {what} take {size} bytes; the limit is "
                            f"{limit}.", "grammar_too_large")
    if spec.kind == "structural_tag" and nesting_depth(json.loads(spec.source), MAX_SCHEMA_DEPTH +
                                                       _TAG_WRAPPING_DEPTH) > MAX_SCHEMA_DEPTH + _TAG_WRAPPING_DEPTH:
        raise _too_deep(param)
    return spec


def _schema_text(schema: dict, param: str) -> str:
    """The schema as the spec's source; a 400 naming ``param`` for one nested too deeply to walk."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise _too_deep(param)
    return json.dumps(schema, sort_keys=True)


def _too_deep(param: str):
    return invalid_param(param, f"Invalid schema for '{param}': it is nested more than {MAX_SCHEMA_DEPTH} "
                         "levels deep.", "grammar_too_large")


def parse_structured_outputs(body: dict[str, Any]) -> GrammarSpec | None:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or as JSON
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object: true``."""
    value = body.get("structured_outputs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_param("structured_outputs", "Invalid type for 'structured_outputs': expected an object.",
                            "invalid_type")
    given = {key: v for key, v in value.items() if v is not None and v is not False}
    unknown = sorted(given.keys() - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise invalid_param(f"structured_outputs.{unknown[0]}", f"'structured_outputs.{unknown[0]}' is not "
                            f"supported; use one of {', '.join(STRUCTURED_OUTPUT_KINDS)}.", "unsupported_parameter")
    if len(given) != 1:
        raise invalid_param("structured_outputs", "'structured_outputs' must set exactly one of "
                            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}.", "invalid_value")
    (kind, v), = given.items()
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        if v is not True:
            raise invalid_param(param, f"Invalid type for '{param}': expected true.", "invalid_type")
        return GrammarSpec("json_object")
    if kind == "json":
        schema = _json_schema(v, param)
        return bounded(GrammarSpec("json_schema", _schema_text(schema, param), strict=False), param)
    if kind == "choice":
        if not isinstance(v, list) or not v or len(v) > MAX_CHOICES or not all(isinstance(c, str) and c for c in v):
            raise invalid_param(param, f"Invalid value for '{param}': expected a list of 1 to {MAX_CHOICES} "
                                "non-empty strings.", "invalid_value")
        return bounded(GrammarSpec("choice", json.dumps(v, ensure_ascii=False)), param)
    if not isinstance(v, str) or not v:
        raise invalid_param(param, f"Invalid type for '{param}': expected a non-empty string.", "invalid_type")
    return bounded(GrammarSpec("regex" if kind == "regex" else "ebnf", v), param)


def _json_schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        bounded(GrammarSpec("json_schema", value), param)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid_param(param, f"Invalid value for '{param}': not JSON ({e}).", "invalid_value") from None
        except RecursionError:
            raise _too_deep(param) from None
    if not isinstance(value, dict):
        raise invalid_param(param, f"Invalid type for '{param}': expected a JSON Schema object.", "invalid_type")
    return value
