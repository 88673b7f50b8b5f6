"""OpenAI function tools and log-probabilities: request validation and response shapes.

Requests: `tools` and `tool_choice` become the tool list the chat template sees; assistant
`tool_calls` and `tool` messages become ToolTurns beside the plain messages. Responses: the
runner's parsed ToolCalls and TokenLogprobs in OpenAI's JSON.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from exo.api.errors import ApiError
from exo.api.wire.openai_chat import FunctionTool, RequestToolCall, ToolChoice
from exo.core.grammar import tool_call_problem
from exo.core.types import TokenLogprob, ToolCall, ToolTurn

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOP_LOGPROBS = 20


def offered_tools(tools: list[dict[str, Any]] | None, choice: str | ToolChoice | None) -> list[dict[str, Any]]:
    """The tools the template is given, as the client sent them: none for tool_choice "none",
    only the named one for a named choice (which `required_call` then enforces)."""
    for n, raw in enumerate(tools or []):
        tool = _checked_tool(n, raw)
        if tool.type != "function":
            raise ApiError(400, f"tools[{n}].type must be 'function'", param=f"tools[{n}].type")
        if not FUNCTION_NAME.match(tool.function.name):
            raise ApiError(400, "function names are 1-64 letters, digits, '_' or '-'", param=f"tools[{n}].function.name")
    if choice is not None and not tools:
        raise ApiError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    as_dicts = list(tools or [])
    if choice is None or choice in ("auto", "required"):
        return as_dicts
    if choice == "none":
        return []
    if isinstance(choice, str):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    named = [t for t in as_dicts if t["function"]["name"] == choice.function.name]
    if choice.type != "function" or not named:
        raise ApiError(400, f"tool_choice names no tool in tools: {choice.function.name!r}", param="tool_choice")
    return named


def required_call(tools: list[dict[str, Any]], required: bool) -> bool:
    """Whether the answer must call one of `tools` ("required", or a named tool): decoding is then
    constrained to a call (exo/core/grammar.py); a 400 when the tools' parameters cannot be enforced."""
    if not (required and tools):
        return False
    if problem := tool_call_problem(tools):
        reason = problem.splitlines()[0].split(": ", 1)[-1]
        raise ApiError(400, f"a required tool call cannot be enforced for these tools: {reason}", param="tools")
    return True


def _checked_tool(n: int, raw: dict[str, Any]) -> FunctionTool:
    try:
        return msgspec.convert(raw, FunctionTool)
    except msgspec.ValidationError as error:
        message = str(error)
        where = message.rsplit("at `$", 1)[1].rstrip("`") if "at `$" in message else ""
        if "missing required field `" in message:
            where += "." + message.split("missing required field `", 1)[1].split("`", 1)[0]
        raise ApiError(400, f"invalid tools[{n}]: {message}", param=f"tools[{n}]{where}") from None


def tool_turn(index: int, role: str, tool_calls: list[RequestToolCall] | None,
              tool_call_id: str | None, name: str | None) -> ToolTurn | None:
    """The tool side of messages[index], or None for a plain message."""
    if role == "tool" and not tool_call_id:
        raise ApiError(400, f"messages[{index}] has role 'tool' but no tool_call_id", param=f"messages[{index}].tool_call_id")
    if tool_calls and role != "assistant":
        raise ApiError(400, f"messages[{index}]: only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")
    for n, call in enumerate(tool_calls or []):
        if call.type != "function":
            raise ApiError(400, "tool call type must be 'function'", param=f"messages[{index}].tool_calls[{n}].type")
    if not tool_calls and not tool_call_id and not name:
        return None
    calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in tool_calls or []]
    return ToolTurn(index=index, tool_calls=calls, tool_call_id=tool_call_id or "", name=name or "")


def check_logprobs(logprobs: bool, top_logprobs: int | None) -> int:
    if top_logprobs is None:
        return 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if top_logprobs and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return top_logprobs


def check_penalty(value: float | None, name: str) -> float | None:
    if value is not None and not -2 <= value <= 2:
        raise ApiError(400, f"{name} must be between -2 and 2", param=name)
    return value


def tool_calls_json(calls: list[ToolCall], first_index: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's tool_calls; streamed deltas also carry each call's index."""
    out = []
    for n, call in enumerate(calls):
        entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        out.append(entry if first_index is None else {"index": first_index + n, **entry})
    return out


def logprobs_json(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in e.top_logprobs]}
        for e in entries
    ], "refusal": None}
