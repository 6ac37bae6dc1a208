"""`response_format`: OpenAI's text, JSON mode and JSON Schema, as the grammar the engine decodes under.

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


async def compile_grammar(engine, spec: GrammarSpec, param: str) -> None:
    """Compile off the event loop (cached by the engine); 400 naming ``param`` if it cannot compile."""
    try:
        await anyio.to_thread.run_sync(engine.grammars.compile, spec)
    except GrammarError as e:
        raise invalid_param(param, f"Invalid schema for '{param}': {e}", "invalid_value") from None
