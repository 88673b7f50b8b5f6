"""Reasoning and tool calls in streamed model output, found the way mlx-lm's own server does.

The tokenizer knows its model's thinking markers (`<think>` ... `</think>` and the like) and its
tool-call markers and parser (mlx-lm picks them from the vocabulary and the chat template). Text
between thinking markers is reasoning; text between tool-call markers is held back and parsed
when the call ends; the rest is content. A prompt that ends inside a thinking block (templates
open one for the model) starts in reasoning. Without markers, text passes through untouched, so
plain generation stays byte-for-byte what mlx-lm produces.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from mlx_lm.generate import TextStateMachine

from exo.core.requests import ToolCall

log = logging.getLogger(__name__)


class Split(NamedTuple):
    text: str  # content
    reasoning: str
    calls: list[ToolCall]


def starts_in_reasoning(tokenizer: Any, prompt: list[int]) -> bool:
    """The prompt's last thinking block is still open: the model's first words are reasoning."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt:
        return False
    start: int = tokenizer.rfind_think_start(prompt)  # mlx-lm's TokenizerWrapper: -1 if none
    end: int = tokenizer.rfind_think_end(prompt)
    return start > end


class OutputSplitter:
    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], call_id_prefix: str, prompt: list[int],
                 reasoning: bool = True) -> None:
        self._tools = tools
        self._prefix = call_id_prefix
        self._count = 0
        self._tool_text = ""
        transitions = _transitions(tokenizer, bool(tools), reasoning)
        self.enabled = bool(transitions)
        if self.enabled:
            self._parse = tokenizer.tool_parser if "tool" in transitions else None
            initial = "reasoning" if "reasoning" in transitions and starts_in_reasoning(tokenizer, prompt) else "normal"
            self._state = TextStateMachine(transitions).make_state(initial)

    def feed(self, text: str) -> Split:
        """What to emit now of this text: content, reasoning, and tool calls it completed."""
        if not self.enabled:
            return Split(text, "", [])
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, finish_reason: str) -> Split:
        """At the end: a call without its end marker is still parsed (some formats have none)."""
        if not self.enabled:
            return Split("", "", [])
        if finish_reason == "stop":
            self._state, current = TextStateMachine.discard(self._state)
            segments = [(current, "")]
        else:
            self._state, rest, current = TextStateMachine.flush(self._state)
            segments = [(current, rest)]
        split = self._collect(segments)
        if self._tool_text:
            split.calls.extend(self._calls_from(self._tool_text))
            self._tool_text = ""
        return split

    def _collect(self, segments: list[tuple[str, str]]) -> Split:
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for state, piece in segments:
            if state == "tool":
                self._tool_text += piece
                continue
            if self._tool_text:  # out of the call: it just ended
                calls.extend(self._calls_from(self._tool_text))
                self._tool_text = ""
            (reasoning if state == "reasoning" else text).append(piece)
        return Split("".join(text), "".join(reasoning), calls)

    def _calls_from(self, tool_text: str) -> list[ToolCall]:
        try:
            assert self._parse is not None  # a tool state exists only with a parser
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


def _transitions(tokenizer: Any, with_tools: bool, with_reasoning: bool) -> dict[str, list[tuple[str, str]]]:
    """As mlx-lm's make_text_state_machine, less stop words (exo/runner/stops.py has those):
    reasoning when the tokenizer has thinking markers, tool calls when the request offers tools."""
    transitions: dict[str, list[tuple[str, str]]] = {}
    thinking = with_reasoning and bool(getattr(tokenizer, "has_thinking", False))
    if thinking:
        transitions["normal"] = [(tokenizer.think_start, "reasoning")]
        transitions["reasoning"] = [(tokenizer.think_end, "normal")]
    if with_tools and getattr(tokenizer, "has_tool_calling", False):
        transitions.setdefault("normal", []).append((tokenizer.tool_call_start, "tool"))
        if thinking:
            transitions["reasoning"].append((tokenizer.tool_call_start, "tool"))
        end = tokenizer.tool_call_end
        transitions["tool"] = [(end, "normal")] if end else []
    return transitions
