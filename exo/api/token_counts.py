"""What the token counting routes share (exo/api/openai/tokenize.py: vLLM's and llama.cpp's
/tokenize and /detokenize; exo/api/anthropic/count_tokens.py): the model's tokenizer, who may
count with it, and the bounds of what one request may have tokenized.

A caller counts for the models its key may use, and only while the key is within its limits, as
a generation would be admitted; the count itself generates nothing, so it adds nothing to usage.
It is not free of cost (tokenizing a million characters takes this node's CPU for a while), so a
key's counting requests also have a `requests_per_minute` window of their own, as Anthropic limits
count_tokens apart from messages: counting never uses up the requests a key may generate. Each
API node keeps that window for the CPU it spends, in memory; the master never hears of it (a
round trip to it would cost more than the count), so N API nodes let a key count N times its
limit per minute. Every count is in the access log and /metrics, as any request is."""

from __future__ import annotations

import math
import time

import msgspec
from aiohttp import web

from exo.api.auth import current_grant
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.tokenizers import TOKENIZERS_KEY, ModelTokenizer
from exo.api.validate import MAX_TOOLS_BYTES
from exo.core.ids import ModelId
from exo.core.keys import WINDOW_S, ApiKey, KeyWindow, Refusal, admission, requests_in_window, window_after
from exo.core.requests import GenerationParams
from exo.core.types import ModelCard
from exo.core.usage import tokens_in_day, tokens_in_month

MAX_TEXT_CHARS = 1_000_000  # text one request may have tokenized (a prompt, or the rendered messages)
MAX_TOKEN_IDS = 1_000_000  # token ids one request may have decoded


class CountingWindows:
    """Each key's counting requests in the last minute on this API node (see the module's docstring)."""

    def __init__(self) -> None:
        self._windows: dict[str, KeyWindow] = {}

    def admit(self, key: ApiKey, now: float) -> Refusal | None:
        """Counts one request of the key at `now`, or says why not and when to come back."""
        limit = key.limits.requests_per_minute
        if not limit:
            return None
        window = self._windows.get(key.key_id, KeyWindow())
        recent = requests_in_window(window, now)
        if len(recent) >= limit:
            return Refusal(reason=f"key {key.key_id} made {len(recent)} token counting requests in the last minute, "
                                  f"its limit of {limit} requests per minute", retry_after_s=recent[-limit] + WINDOW_S - now)
        self._windows[key.key_id] = window_after(window, key, now)
        return None


COUNTING_WINDOWS_KEY = web.AppKey("exo_counting_windows", CountingWindows)  # the app's, set by build_app


async def tokenizer_for(request: web.Request, card: ModelCard) -> ModelTokenizer:
    return await request.app[TOKENIZERS_KEY].of(card)


def counting_card(request: web.Request, model_id: ModelId) -> ModelCard:
    """The model's card, for a caller its key lets use it and whose limits are not reached (as a
    generation would be refused, only without asking the master: counting changes nothing)."""
    ctx = context_of(request)
    card = ctx.require_card(model_id)
    grant = current_grant.get()
    if not grant.may_use(model_id):
        raise ApiError(403, f"API key {grant.key.key_id if grant.key else ''} may not use the model {model_id!r} "
                            "(its model patterns do not match)", param="model", code="model_not_allowed")
    key, state, now = grant.key, ctx.view.state, time.time()
    if key is not None:  # a key of State's, admin or not, as the master admits its generations
        # Concurrent requests are not checked: counting opens none.
        refusal = admission(key, state.key_windows.get(key.key_id, KeyWindow()), 0,
                            tokens_in_day(state.usage, key.key_id, now), tokens_in_month(state.usage, key.key_id, now), now)
        refusal = refusal or request.app[COUNTING_WINDOWS_KEY].admit(key, now)
        if refusal is not None:
            raise ApiError(429, refusal.reason, code="rate_limited",
                           headers={"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))})
    return card


def only_placed_model(ctx: ApiContext, model: ModelId | None) -> ModelId:
    """The model asked for, else the only one placed (llama.cpp's shapes name none)."""
    if model is not None:
        return model
    placed = sorted({instance.model_id for instance in ctx.view.state.instances.values()})
    if len(placed) != 1:
        which = f"{len(placed)} are placed ({', '.join(placed)})" if placed else "none is placed"
        raise ApiError(400, f"model is required: it can be left out only while one model is placed, and {which}",
                       param="model")
    return placed[0]


def countable(params: GenerationParams) -> GenerationParams:
    """A conversation whose prompt the API node can render: text only (an image's tokens are the
    vision processor's, on the runner), tool definitions within chat's bound."""
    if any(message.images for message in params.messages):
        raise ApiError(400, "counting the tokens of images is not supported: send the messages without them",
                       param="messages")
    if params.tools and len(msgspec.json.encode(params.tools)) > MAX_TOOLS_BYTES:
        raise ApiError(400, f"tool definitions must be at most {MAX_TOOLS_BYTES} bytes of JSON", param="tools")
    return params


def checked_length(text: str, param: str) -> str:
    if len(text) > MAX_TEXT_CHARS:
        raise ApiError(400, f"{param}: at most {MAX_TEXT_CHARS} characters are tokenized, got {len(text)}", param=param)
    return text
