"""A response_format as the grammar that constrains the answer (llguidance's, from the JSON
schema, the regex, the choices or the Lark / GBNF text), and why one cannot be enforced. Pure: the
API refuses a format with this before any work, and the runner compiles the very same grammar
(exo/runner/constraint.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from exo.core.requests import ResponseFormat

# Compact JSON: no free whitespace between tokens, which a weak model can repeat until max_tokens.
_COMPILE = {"whitespace_flexible": False}


def grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar of a response format; ValueError when the schema or GBNF is malformed
    (a bad regex or Lark grammar shows only when compiled: grammar_problem)."""
    if response_format.type == "regex":
        return LLMatcher.grammar_from_regex(response_format.pattern)
    if response_format.type == "choice":  # JSON string literals are Lark's, escapes included
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in response_format.choices))
    if response_format.type == "grammar":
        return LLMatcher.grammar_from_lark(_lark_of(response_format.grammar, response_format.syntax))
    schema = response_format.json_schema if response_format.type == "json_schema" else {"type": "object"}
    return LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE)  # type: ignore[arg-type]


def syntax_of(grammar: str) -> Literal["lark", "gbnf"]:
    """Which syntax a grammar of unnamed syntax is written in (vLLM's guided_grammar takes both)."""
    return "lark" if is_lark_syntax(grammar) else "gbnf"


def _lark_of(grammar: str, syntax: Literal["lark", "gbnf"]) -> str:
    if syntax == "lark":
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter's own error, or whatever its parser trips on
        raise ValueError(f"not a GBNF grammar: {error}") from None


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
