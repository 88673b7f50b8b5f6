"""A response_format as the grammar that constrains the answer (llguidance's, from the JSON
schema), and why one cannot be enforced. Pure: the API refuses a format with this before any
work, and the runner compiles the very same grammar (exo/runner/constraint.py)."""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from exo.core.types import ResponseFormat

# Compact JSON: no free whitespace between tokens, which a weak model can repeat until max_tokens.
_COMPILE = {"whitespace_flexible": False}


def grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar of a response format; ValueError when the schema is malformed."""
    schema = response_format.json_schema if response_format.type == "json_schema" else {"type": "object"}
    return LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE)  # type: ignore[arg-type]


def tool_call_grammar(tools: list[dict[str, Any]], start: list[int], end: list[int]) -> str:
    """One or more JSON tool calls between the model's call markers (token ids), each naming one
    of `tools` with arguments valid for its parameters: what mlx-lm's json_tools parser reads."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": _COMPILE}  # compact, as above
    marks = ["".join(f"<[{token}]>" for token in ids) for ids in (start, end)]
    call = f'{marks[0]} "\\n"? %json {json.dumps(schema)} "\\n"? {marks[1]} "\\n"?'
    return LLMatcher.grammar_from_lark(f"start: call+\ncall: {call}\n")


def tool_call_problem(tools: list[dict[str, Any]]) -> str:
    """Why a call to one of these tools cannot be required ('' when it can)."""
    try:
        return LLMatcher.validate_grammar(tool_call_grammar(tools, [0], [1]))
    except ValueError as error:
        return str(error)


def grammar_problem(response_format: ResponseFormat) -> str:
    """Why this format cannot be enforced ('' when it can): unknown keywords or formats and the like."""
    try:
        return LLMatcher.validate_grammar(grammar_of(response_format))
    except ValueError as error:
        return str(error)
