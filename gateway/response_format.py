"""The grammar a request's output must match: OpenAI's `response_format` (text, JSON mode, JSON
Schema) or vLLM's `structured_outputs` (a JSON schema, a regex, a choice of strings, an EBNF grammar
or JSON mode), as the spec the engine decodes under.

A schema is compiled here, on a worker thread, so that an uncompilable one is a
400 that says why before anything is reserved, and the engine's own compile at
admission is a cache hit.
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread

from engine.grammar import GrammarError, GrammarSpec
from gateway.errors import invalid_param

FORMAT_TYPES = ("text", "json_object", "json_schema")


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
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True), strict=bool(strict))


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
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True), strict=False)
    if kind == "choice":
        if not isinstance(v, list) or not v or len(v) > MAX_CHOICES or not all(isinstance(c, str) and c for c in v):
            raise invalid_param(param, f"Invalid value for '{param}': expected a list of 1 to {MAX_CHOICES} "
                                "non-empty strings.", "invalid_value")
        return GrammarSpec("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise invalid_param(param, f"Invalid type for '{param}': expected a non-empty string.", "invalid_type")
    return GrammarSpec("regex" if kind == "regex" else "ebnf", v)


def _json_schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid_param(param, f"Invalid value for '{param}': not JSON ({e}).", "invalid_value") from None
    if not isinstance(value, dict):
        raise invalid_param(param, f"Invalid type for '{param}': expected a JSON Schema object.", "invalid_type")
    return value


async def compile_grammar(engine, spec: GrammarSpec, param: str) -> None:
    """Compile off the event loop (cached by the engine); 400 naming ``param`` if it cannot compile."""
    try:
        await anyio.to_thread.run_sync(engine.grammars.compile, spec)
    except GrammarError as e:
        what = "schema" if param in ("response_format", "tools") else "value"
        raise invalid_param(param, f"Invalid {what} for '{param}': {e}", "invalid_value") from None
