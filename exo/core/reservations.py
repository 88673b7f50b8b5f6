"""The tokens a request may use at most, reserved against its key's token limits while it is
open (pending or running), so that concurrent requests cannot together pass a limit that each
alone fits (exo/core/keys.py `admission`). Derived from State: the open tasks' params, never
from a master's memory, so a new master reserves what the old one did.

A bound, not a guess: a limit that holds needs an upper bound, and the part a request does not
use is released when it ends (its actual tokens are counted then, exo/core/usage.py).

- its prompt: the UTF-8 bytes of its text (a byte-level tokenizer's token is at least one byte),
  plus an allowance for what the chat template adds (role markers, a default system prompt, the
  tool-calling instructions) and for each image;
- its answer: `max_tokens`, or without it what the runner would allow: DEFAULT_MAX_TOKENS, within
  the context left after the prompt;
- the whole: at most the model's context (a longer prompt is refused, and counts nothing);
- several choices (n, or best_of candidates): the prompt once (it is prefilled and counted once),
  and each choice's answer, as its usage will count them.

Pure: no I/O.
"""

from __future__ import annotations

import msgspec

from exo.core.requests import GenerationParams, rows_of

DEFAULT_MAX_TOKENS = 2048  # the runner's max_tokens when a request names none (exo/runner/engine.py uses this)
CHAT_TOKENS = 64  # a chat template's tokens besides the messages: BOS, the answer's header, a default system prompt
MESSAGE_TOKENS = 8  # a message's role markers
TOOLS_TOKENS = 256  # the instructions a template wraps tool definitions in
IMAGE_TOKENS = 2048  # an image's tokens in a vision model's prompt (capped by the context like the rest)
RAW_PROMPT_TOKENS = 2  # a raw prompt's (completions) BOS and EOS


def reserved_tokens(params: GenerationParams, context: int) -> int:
    """The most tokens (prompt + each choice's answer) a request with `params` can use on a model whose
    instances have `context` tokens of room (0: unknown)."""
    prompt = prompt_bound(params)
    if params.embed is not None:
        answer = 0
    elif params.max_tokens is not None:
        answer = params.max_tokens
    else:
        answer = min(DEFAULT_MAX_TOKENS, max(context - prompt, 0)) if context else DEFAULT_MAX_TOKENS
    one = min(prompt + answer, context) if context else prompt + answer
    return one + (rows_of(params) - 1) * max(one - prompt, 0)


def prompt_bound(params: GenerationParams) -> int:
    if params.embed is not None:
        inputs = params.embed
        return sum(_bytes(t) + RAW_PROMPT_TOKENS for t in inputs.texts) + sum(len(ids) for ids in inputs.token_ids)
    if params.prompt is not None:
        return _bytes(params.prompt) + RAW_PROMPT_TOKENS
    messages = sum(_bytes(m.content) + MESSAGE_TOKENS + IMAGE_TOKENS * len(m.images) for m in params.messages)
    tools = len(msgspec.json.encode(params.tools)) + TOOLS_TOKENS if params.tools else 0
    calls = sum(len(msgspec.json.encode(turn)) for turn in params.tool_turns)
    return CHAT_TOKENS + messages + tools + calls


def _bytes(text: str) -> int:
    return len(text.encode())
