"""What routing needs to know of a request's prompt, without its text: a digest per message.

State keeps the last 1,000 finished tasks; kept whole, their messages (up to a model's context
each) would make State, and every snapshot of it, grow with the length of users' prompts. A
finished task keeps its digest instead of its text (exo/core/apply.py), and routing
(exo/master/routing.py) compares digests: two messages are the same if their digests are.
"""

from __future__ import annotations

import hashlib

import msgspec

from exo.core.requests import GenerationParams
from exo.core.types import ConversationDigest

_encoder = msgspec.json.Encoder(order="deterministic")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]  # 128 bits: no accidental match between prompts


def digest_conversation(params: GenerationParams) -> ConversationDigest:
    return ConversationDigest(
        roles=[m.role for m in params.messages],
        messages=[_digest(_encoder.encode(m)) for m in params.messages],
        chars=[len(m.content) + 1 for m in params.messages],
        tools=_digest(_encoder.encode(params.tools)) if params.tools else "",
        prompt_chars=len(params.prompt) if params.prompt is not None else -1,
        prompt=_digest(params.prompt.encode()) if params.prompt is not None else "",
    )


def prompt_starts_with(prompt: str, earlier: ConversationDigest) -> bool:
    """Whether `prompt` begins with the raw prompt that `earlier` digests."""
    return 0 <= earlier.prompt_chars <= len(prompt) and _digest(prompt[:earlier.prompt_chars].encode()) == earlier.prompt


def without_text(params: GenerationParams) -> GenerationParams:
    """A finished request's parameters, less what grows with its prompt (kept as its digest)."""
    return msgspec.structs.replace(params, messages=[], prompt=None, tools=[], tool_turns=[], stop=[],
                                   response_format=None, logit_bias={})
