"""Structured outputs: each surface's answer-format field as one ResponseFormat, refused with a
400 naming what cannot be enforced (never silently ignored).

OpenAI chat: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}; Responses: `text.format` {"type", "name", "schema", "strict"};
Ollama: `format` "json" or a schema. The runner constrains decoding to it (exo/runner/constraint.py).
"""

from __future__ import annotations

from typing import Any

from exo.api.errors import ApiError
from exo.core.grammar import grammar_problem
from exo.core.types import ResponseFormat

_TYPES = ("text", "json_object", "json_schema")


def response_format_of(kind: Any, schema: Any, name: Any, param: str, schema_param: str) -> ResponseFormat | None:
    """`kind` is the format's type; for json_schema, `schema` the schema (at `schema_param`)."""
    if kind not in _TYPES:
        raise ApiError(400, f"{param}.type must be one of {list(_TYPES)}, got {kind!r}", param=f"{param}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    if not isinstance(schema, dict):
        raise ApiError(400, f"{schema_param} must be a JSON schema (an object)", param=schema_param)
    response_format = ResponseFormat(type="json_schema", json_schema=schema, name=name if isinstance(name, str) else "")
    if problem := grammar_problem(response_format):
        raise ApiError(400, f"{schema_param} cannot be enforced: {problem}", param=schema_param)
    return response_format


def openai_chat_format(raw: dict[str, Any] | None) -> ResponseFormat | None:
    if raw is None:
        return None
    spec = raw.get("json_schema")
    if raw.get("type") == "json_schema" and not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema is required for type 'json_schema'",
                       param="response_format.json_schema")
    spec = spec if isinstance(spec, dict) else {}
    return response_format_of(raw.get("type"), spec.get("schema"), spec.get("name"), "response_format",
                              "response_format.json_schema.schema")


def responses_format(raw: dict[str, Any] | None) -> ResponseFormat | None:
    if raw is None:
        return None
    return response_format_of(raw.get("type"), raw.get("schema"), raw.get("name"), "text.format", "text.format.schema")


def ollama_format(raw: str | dict[str, Any] | None) -> ResponseFormat | None:
    if raw is None or raw == "":
        return None
    if raw == "json":
        return ResponseFormat(type="json_object")
    if isinstance(raw, str):
        raise ApiError(400, f"format must be 'json' or a JSON schema, got {raw!r}")
    return response_format_of("json_schema", raw, "", "format", "format")
