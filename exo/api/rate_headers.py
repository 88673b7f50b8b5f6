"""Rate-limit headers on every response to a key with per-minute limits, from this node's State
(the master's windows, folded from the log): OpenAI's `x-ratelimit-{limit,remaining,reset}-
{requests,tokens}` everywhere, and Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,
remaining,reset}` on /v1/messages. A 429 says when to come back in `Retry-After` (outcomes.py)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from aiohttp import web

from exo.api.auth import Grant
from exo.api.context import context_of
from exo.core.keys import WINDOW_S, KeyWindow, minute_tokens, next_minute, requests_in_window


async def add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    grant = request.get("grant")
    if not isinstance(grant, Grant) or grant.key is None:
        return
    limits = grant.key.limits
    if not (limits.requests_per_minute or limits.tokens_per_minute):
        return
    now = time.time()
    window = context_of(request).view.state.key_windows.get(grant.key.key_id, KeyWindow())
    anthropic = request.path.startswith("/v1/messages")
    if limits.requests_per_minute:
        recent = requests_in_window(window, now)
        reset = recent[-1] + WINDOW_S - now if recent else 0.0  # when every slot is free again
        _set(response, anthropic, "requests", limits.requests_per_minute,
             max(limits.requests_per_minute - len(recent), 0), now, reset)
    if limits.tokens_per_minute:
        used = minute_tokens(window, now)
        _set(response, anthropic, "tokens", limits.tokens_per_minute, max(limits.tokens_per_minute - used, 0), now,
             next_minute(now) - now if used else 0.0)


def _set(response: web.StreamResponse, anthropic: bool, what: str, limit: int, remaining: int, now: float,
         reset_s: float) -> None:
    if anthropic:
        response.headers[f"anthropic-ratelimit-{what}-limit"] = str(limit)
        response.headers[f"anthropic-ratelimit-{what}-remaining"] = str(remaining)
        reset_at = datetime.fromtimestamp(now + reset_s, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        response.headers[f"anthropic-ratelimit-{what}-reset"] = reset_at
    else:
        response.headers[f"x-ratelimit-limit-{what}"] = str(limit)
        response.headers[f"x-ratelimit-remaining-{what}"] = str(remaining)
        response.headers[f"x-ratelimit-reset-{what}"] = duration(reset_s)


def duration(seconds: float) -> str:
    """OpenAI's form: "1s", "6m0s", "250ms"."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"
