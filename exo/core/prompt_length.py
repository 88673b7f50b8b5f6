"""The fewest tokens a request's prompt can be, from its length alone: a prompt whose floor already
fills the model's context is refused without tokenizing it (tokenizing megabytes takes seconds).

A token covers at most so many characters of text. The runner knows its tokenizer's longest
token (exo/runner/engine.py); an API node has no tokenizer, so it takes API_CHARS_PER_TOKEN.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from exo.core.requests import GenerationParams

# Text averages 3 to 5 characters a token (code and JSON fewer); only long runs of one repeated
# character pack more. So a prompt past 32 characters a token of the context is refused at the API;
# the runner checks the exact count of any prompt this lets through.
API_CHARS_PER_TOKEN = 32


def prompt_chars(params: GenerationParams) -> int:
    """The characters of the request's own text in its prompt (a chat template adds more)."""
    if params.prompt is not None:
        return len(params.prompt)
    return sum(len(message.content) for message in params.messages)


def too_long(params: GenerationParams, context: int, chars_per_token: int) -> str | None:
    """Why the prompt cannot fit `context` tokens whatever it tokenizes to, or None if it may
    (`context` or `chars_per_token` 0: unknown). A generation needs room for one token after its
    prompt; an embedding input may fill the context."""
    if context <= 0 or chars_per_token <= 0:
        return None
    if params.embed is not None:
        for n, text in enumerate(params.embed.texts):
            if len(text) // chars_per_token > context:
                return (f"input {n} is {len(text)} characters, at least {len(text) // chars_per_token} tokens "
                        f"(a token covers at most {chars_per_token}): over the model's context of {context}")
        return None
    chars = prompt_chars(params)
    if chars // chars_per_token < context:
        return None
    return (f"the prompt is {chars} characters, at least {chars // chars_per_token} tokens (a token covers at most "
            f"{chars_per_token}); this instance's context is {context}")


def token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can cover: its longest vocabulary entry (a byte-level
    entry is one character a byte, so it covers no more characters than it has), times four, as
    a normalizer may compose up to four characters into one (Unicode NFC and NFKC)."""
    vocabulary: dict[str, int] = tokenizer.get_vocab()
    return 4 * max(map(len, vocabulary), default=0)
