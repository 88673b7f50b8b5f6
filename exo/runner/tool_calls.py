"""Tool calls in streamed model output, found and parsed the way mlx-lm's own server does it.

The tokenizer knows its model's tool-call markers and parser (mlx-lm picks them from the chat
template); text between the markers is held back from the content and parsed when the call
ends. Without tools in the request, or a tokenizer without a tool parser, text passes through
untouched, so plain generation stays byte-for-byte what mlx-lm produces.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mlx_lm.generate import TextStateMachine

from exo.core.types import ToolCall

log = logging.getLogger(__name__)


class ToolCallSplitter:
    def __init__(self, tokenizer: Any, tools: list[dict], call_id_prefix: str) -> None:
        self.enabled = bool(tools) and bool(getattr(tokenizer, "has_tool_calling", False))
        self._tools = tools
        self._prefix = call_id_prefix
        self._count = 0
        self._tool_text = ""
        if self.enabled:
            self._parse = tokenizer.tool_parser
            end = tokenizer.tool_call_end
            machine = TextStateMachine({
                "normal": [(tokenizer.tool_call_start, "tool")],
                "tool": [(end, "normal")] if end else [],
            })
            self._state = machine.make_state("normal")

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Returns (content text to emit now, tool calls completed by this text)."""
        if not self.enabled:
            return text, []
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCall]]:
        """At the end: a call without its end marker is still parsed (some formats have none)."""
        if not self.enabled:
            return "", []
        if finish_reason == "stop":
            self._state, current = TextStateMachine.discard(self._state)
            segments = [(current, "")]
        else:
            self._state, rest, current = TextStateMachine.flush(self._state)
            segments = [(current, rest)]
        text, calls = self._collect(segments)
        if self._tool_text:
            calls.extend(self._calls_from(self._tool_text))
            self._tool_text = ""
        return text, calls

    def _collect(self, segments: list[tuple[str, str]]) -> tuple[str, list[ToolCall]]:
        text: list[str] = []
        calls: list[ToolCall] = []
        for state, piece in segments:
            if state == "tool":
                self._tool_text += piece
                continue
            if self._tool_text:  # back to normal text: the call just ended
                calls.extend(self._calls_from(self._tool_text))
                self._tool_text = ""
            text.append(piece)
        return "".join(text), calls

    def _calls_from(self, tool_text: str) -> list[ToolCall]:
        try:
            parsed = self._parse(tool_text, self._tools)
        except (ValueError, KeyError, TypeError) as error:  # json errors are ValueErrors
            log.warning("cannot parse a tool call (%s: %s): %r", type(error).__name__, error, tool_text[:200])
            return []
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            arguments = call.get("arguments", {})
            calls.append(ToolCall(
                id=call.get("id") or f"call_{self._prefix}_{self._count}",
                name=str(call.get("name", "")),
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
            ))
            self._count += 1
        return calls
