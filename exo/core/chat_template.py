"""A request's conversation as chat templates take it, and the prompt text a tokenizer's template
renders from it: what the runner generates from and what the API's token counts count, one
function for both so the two cannot differ."""

from __future__ import annotations

import json
from typing import Any

from exo.core.requests import GenerationParams


def template_messages(params: GenerationParams) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, with earlier turns' tool calls and results."""
    turns = {turn.index: turn for turn in params.tool_turns}
    messages = []
    for index, message in enumerate(params.messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        turn = turns.get(index)
        if turn is not None and turn.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in turn.tool_calls
            ]
        if turn is not None and turn.tool_call_id:
            entry["tool_call_id"] = turn.tool_call_id
        if turn is not None and turn.name:
            entry["name"] = turn.name
        messages.append(entry)
    return messages


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  enable_thinking: bool | None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
    """The prompt's text from mlx-lm's TokenizerWrapper (`tokenizer`); a model without a chat
    template gets the messages' contents, one a line."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(m["content"] for m in messages)
    # enable_thinking left out: mlx-lm's wrapper passes its default (on when the model thinks).
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    # continue_final_message only when asked: older templates' callers do not know the argument.
    extra = {"continue_final_message": True} if continue_final_message else {}
    prompt: str = tokenizer.apply_chat_template(  # tokenize=False: the text
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False, **switch, **extra)
    return prompt


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids exactly as mlx-lm's stream_generate makes them from the same text:
    special tokens added unless the template already began with the BOS token."""
    bos = tokenizer.bos_token
    ids: list[int] = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return ids


def _arguments(text: str) -> Any:
    # Templates render arguments as a mapping (mlx-lm's server decodes them the same way).
    try:
        return json.loads(text)
    except ValueError:
        return text
