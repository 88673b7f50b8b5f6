"""A response_format as the grammar that constrains the answer (llguidance's, from the JSON
schema), and why one cannot be enforced. Pure: the API refuses a format with this before any
work, and the runner compiles the very same grammar (exo/runner/constraint.py)."""

from __future__ import annotations

from llguidance import LLMatcher

from exo.core.types import ResponseFormat

# Compact JSON: no free whitespace between tokens, which a weak model can repeat until max_tokens.
_COMPILE = {"whitespace_flexible": False}


def grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar of a response format; ValueError when the schema is malformed."""
    schema = response_format.json_schema if response_format.type == "json_schema" else {"type": "object"}
    return LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE)  # type: ignore[arg-type]


def grammar_problem(response_format: ResponseFormat) -> str:
    """Why this format cannot be enforced ('' when it can): unknown keywords or formats and the like."""
    try:
        return LLMatcher.validate_grammar(grammar_of(response_format))
    except ValueError as error:
        return str(error)
