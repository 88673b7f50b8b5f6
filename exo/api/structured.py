"""Structured outputs: each surface's answer-format field as one ResponseFormat, refused with a
400 naming what cannot be enforced (never silently ignored).

OpenAI chat: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}; Responses: `text.format` {"type", "name", "schema", "strict"};
Ollama: `format` "json" or a schema. OpenAI chat and completions also take vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark or GBNF) and `structured_outputs` {json |
regex | choice | grammar | json_object}, and llama.cpp's `grammar` (GBNF) and `json_schema`: one of
them per request. The runner constrains decoding to it (exo/runner/constraint.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from exo.api.errors import ApiError
from exo.core.grammar import grammar_problem, syntax_of
from exo.core.requests import ResponseFormat

_TYPES = ("text", "json_object", "json_schema")
# Sizes as JSON, as the request stores them: with the rest of a format, within validate's MAX_SCHEMA_BYTES.
MAX_GRAMMAR_BYTES = 32 * 1024  # a grammar, or all choices together
MAX_PATTERN_BYTES = 4 * 1024
MAX_CHOICES = 256
MAX_CHOICE_BYTES = 1024  # each


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
    return _enforceable(ResponseFormat(type="json_schema", json_schema=schema, name=name if isinstance(name, str) else ""),
                        schema_param)


def schema_format(schema: Any, param: str) -> ResponseFormat | None:
    """A JSON schema given as an object, or as its JSON text (vLLM's guided_json takes both)."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError:
            raise ApiError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
    return response_format_of("json_schema", schema, "", param, param)


def regex_format(pattern: Any, param: str) -> ResponseFormat:
    """The whole answer matches `pattern`."""
    if not isinstance(pattern, str):
        raise ApiError(400, f"{param} must be a regular expression (a string)", param=param)
    _within(pattern, MAX_PATTERN_BYTES, param)
    return _enforceable(ResponseFormat(type="regex", pattern=pattern), param)


def choice_format(choices: Any, param: str) -> ResponseFormat:
    """The answer is exactly one of `choices`."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ApiError(400, f"{param} must be a non-empty list of strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise ApiError(400, f"{param} must have at most {MAX_CHOICES} choices, got {len(choices)}", param=param)
    for n, choice in enumerate(choices):
        _within(choice, MAX_CHOICE_BYTES, f"{param}[{n}]")
    _within(choices, MAX_GRAMMAR_BYTES, param)
    return _enforceable(ResponseFormat(type="choice", choices=choices), param)


def grammar_format(grammar: Any, syntax: Literal["lark", "gbnf"] | None, param: str) -> ResponseFormat:
    """The answer is a sentence of `grammar`; `syntax` None: Lark if it reads as Lark, else GBNF (as vLLM)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ApiError(400, f"{param} must be a grammar (Lark or GBNF text)", param=param)
    _within(grammar, MAX_GRAMMAR_BYTES, param)
    return _enforceable(ResponseFormat(type="grammar", grammar=grammar, syntax=syntax or syntax_of(grammar)), param)


def _within(value: Any, limit: int, param: str) -> None:
    size = len(msgspec.json.encode(value))
    if size > limit:
        raise ApiError(400, f"{param} must be at most {limit} bytes of JSON, got {size}", param=param)


def _enforceable(response_format: ResponseFormat, param: str) -> ResponseFormat:
    if problem := grammar_problem(response_format):
        raise ApiError(400, f"{param} cannot be enforced: {problem}", param=param)
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


def _structured_outputs(raw: Any, param: str) -> ResponseFormat | None:
    """vLLM's structured_outputs object: one of its constraints; options exo cannot honour are refused."""
    if not isinstance(raw, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    given = {key: value for key, value in raw.items() if value is not None and value is not False}
    if unknown := sorted(given.keys() - _STRUCTURED.keys() - _HONOURED_OPTIONS):
        raise ApiError(400, f"{param}.{unknown[0]} is not supported; one of {sorted(_STRUCTURED)} is",
                       param=f"{param}.{unknown[0]}")
    return _one_of({f"{param}.{key}": (_STRUCTURED[key], value) for key, value in given.items() if key in _STRUCTURED})


def _one_of(given: dict[str, tuple[Callable[[Any, str], ResponseFormat | None], Any]]) -> ResponseFormat | None:
    """The one format among fields given (param -> its reader and value); two at once is a 400 naming both."""
    formats = [(param, f) for param, (read, value) in given.items() if (f := read(value, param)) is not None]
    if len(formats) > 1:
        first, second = formats[0][0], formats[1][0]
        raise ApiError(400, f"{first} and {second} cannot be combined: give one constraint", param=second)
    return formats[0][1] if formats else None


_STRUCTURED: dict[str, Callable[[Any, str], ResponseFormat | None]] = {
    "json": schema_format, "regex": regex_format, "choice": choice_format,
    "grammar": lambda grammar, param: grammar_format(grammar, None, param),
    "json_object": lambda _, param: ResponseFormat(type="json_object")}
_HONOURED_OPTIONS = {"disable_fallback", "disable_any_whitespace"}  # exo has no fallback and no free whitespace

# OpenAI chat and completions: each field that may constrain the answer, and how to read it.
_OPENAI_FIELDS: dict[str, Callable[[Any, str], ResponseFormat | None]] = {
    "response_format": lambda raw, _: openai_chat_format(raw),
    "guided_json": schema_format, "guided_regex": regex_format, "guided_choice": choice_format,
    "guided_grammar": lambda grammar, param: grammar_format(grammar, None, param),
    "structured_outputs": _structured_outputs,
    "grammar": lambda grammar, param: grammar_format(grammar, "gbnf", param) if grammar != "" else None,  # llama.cpp's
    "json_schema": schema_format}


def openai_constraint(fields: dict[str, Any]) -> ResponseFormat | None:
    """The answer's constraint from an OpenAI chat or completions body's fields (name -> value, None
    when absent): at most one of response_format, vLLM's and llama.cpp's fields."""
    return _one_of({name: (_OPENAI_FIELDS[name], value) for name, value in fields.items() if value is not None})
