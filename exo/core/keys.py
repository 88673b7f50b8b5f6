"""API keys kept in State (hashed: never the secret), what each may do, and its limits.

Limits are enforced by the master when it admits a generation (exo/master/decide.py), against
State: the master decides every command in order, each against the State its earlier decisions
left, so however many API nodes take a key's requests, the key gets its limit and not one
request more. The windows it counts in are State too (`KeyWindow`), folded from the log, so a new
master counts on where the old one stopped, and `exo replay` recomputes them.

- requests per minute: a sliding window of the key's admitted requests' times (at most its
  limit's worth kept);
- tokens per minute: prompt + completion tokens of the requests the key started in the current
  clock minute, counted when each finishes;
- concurrent requests: its open (pending or running) tasks, one of n choices (or best_of
  candidates) counting n: each is a row of a batch (requests.rows_of);
- tokens per day / per month: its usage (exo/core/usage.py) in the current UTC day / month.

Token limits count what open requests may still use too: each reserves its most tokens
(exo/core/reservations.py) until it ends, and a request whose reservation does not fit beside the
used and reserved tokens is refused, so concurrent requests cannot pass a limit together.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Literal

import msgspec

from exo.core.usage import days_from_civil, month_of

Tier = Literal["interactive", "batch"]  # vLLM's priority, OpenAI's service_tier: interactive first
WINDOW_S = 60.0
MAX_REQUESTS_PER_MINUTE = 10_000
_KEY_ID = re.compile(r"key_[0-9a-f]{16}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CACHE_SCOPE = re.compile(r"[A-Za-z0-9._-]{0,64}")


class KeyLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """0: no limit."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    concurrent_requests: int = 0
    tokens_per_day: int = 0
    tokens_per_month: int = 0

    def problem(self) -> str | None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not 0 <= value <= 10**12:
                return f"limits.{name} must be between 0 (no limit) and 10^12, not {value}"
        if self.requests_per_minute > MAX_REQUESTS_PER_MINUTE:  # State keeps that many request times per key
            return (f"limits.requests_per_minute must be at most {MAX_REQUESTS_PER_MINUTE} (0: no limit), "
                    f"not {self.requests_per_minute}")
        return None


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str  # "key_" + 16 hex: how it is named in /keys, /usage and /metrics
    secret_sha256: str  # the secret's sha256 hex: a presented key is hashed and looked up
    name: str = ""
    admin: bool = False  # may manage keys, models and instances, and read every key's usage
    models: list[str] = []  # glob patterns of the model ids it may use ("org/*", "*:pirate"); empty: all
    limits: KeyLimits = KeyLimits()
    priority: Tier = "interactive"
    created_at: float = 0.0
    # Keys with the same cache_scope share prompt-cache hits (a team's long system prompt); "": its own.
    cache_scope: str = ""

    def problem(self) -> str | None:
        if not _KEY_ID.fullmatch(self.key_id):
            return f"invalid key id {self.key_id!r}"
        if not _SHA256.fullmatch(self.secret_sha256):
            return "secret_sha256 must be 64 lowercase hex digits"
        if len(self.name) > 200 or len(self.models) > 100 or any(len(p) > 200 for p in self.models):
            return "a key's name and model patterns are at most 200 characters, and at most 100 patterns"
        if not _CACHE_SCOPE.fullmatch(self.cache_scope):
            return "cache_scope must be at most 64 letters, digits, '.', '_' or '-' (\"\": the key's own scope)"
        return self.limits.problem()

    def may_use(self, model_id: str) -> bool:
        return not self.models or any(fnmatch.fnmatchcase(model_id, pattern) for pattern in self.models)


def cache_scope_of(key: ApiKey | None) -> str:
    """Whose prompt-cache entries a request may reuse (docs/prompt-cache.md): its key's own, or the
    cache_scope several keys share; "" for requests without a key (no keys, or EXO_API_KEYS).
    Prefixed, so a shared scope's name can never equal a key's own scope."""
    if key is None:
        return ""
    return f"scope:{key.cache_scope}" if key.cache_scope else f"key:{key.key_id}"


class KeyWindow(msgspec.Struct, frozen=True, kw_only=True):
    """What the master counts a key's per-minute limits in (see the module's docstring)."""

    requests: list[float] = []  # admission times of its latest requests, oldest first (its limit's worth)
    minute: int = 0  # the clock minute (time // 60) `minute_tokens` counts
    minute_tokens: int = 0


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    retry_after_s: float


class Reserved(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens the key's open requests hold (exo/core/reservations.py) in each period its token limits
    count in (a request counts in the minute, day and month it started), and what one more asks."""

    asked: int = 0
    minute: int = 0
    day: int = 0
    month: int = 0


NOTHING_RESERVED = Reserved()


def admission(key: ApiKey, window: KeyWindow, open_rows: int, used_day: int, used_month: int,
              at: float, reserved: Reserved = NOTHING_RESERVED, rows: int = 1) -> Refusal | None:
    """Whether the key may start one more request, of `rows` rows (requests.rows_of), at `at` (wall
    clock) beside its open requests' `open_rows`, and if not, why and when."""
    limits = key.limits
    if limits.concurrent_requests and open_rows + rows > limits.concurrent_requests:
        return _concurrency_refusal(key.key_id, limits.concurrent_requests, open_rows, rows)
    recent = requests_in_window(window, at)
    if limits.requests_per_minute and len(recent) >= limits.requests_per_minute:
        return Refusal(reason=f"key {key.key_id} made {len(recent)} requests in the last minute, its limit",
                       retry_after_s=max(recent[-limits.requests_per_minute] + WINDOW_S - at, 0.001))
    periods = ((limits.tokens_per_minute, minute_tokens(window, at), reserved.minute, "this minute", "limit",
                next_minute(at)),
               (limits.tokens_per_day, used_day, reserved.day, "today (UTC)", "daily quota", _next_day(at)),
               (limits.tokens_per_month, used_month, reserved.month, "this month (UTC)", "monthly quota",
                _next_month(at)))
    for limit, used, held, when, name, period_end in periods:
        if limit and (used >= limit or used + held + reserved.asked > limit):
            return _tokens_refusal(key.key_id, limit, used, held, reserved.asked, (when, name), period_end - at)
    return None


def _concurrency_refusal(key_id: str, limit: int, open_rows: int, rows: int) -> Refusal:
    if rows > limit:
        return Refusal(reason=f"key {key_id}: this request's {rows} choices (n or best_of) count as {rows} requests, "
                              f"more than its limit of {limit} concurrent requests: send a smaller n",
                       retry_after_s=1.0)
    counted = f", and this one's {rows} choices (n or best_of) count as {rows}" if rows > 1 else ""
    return Refusal(reason=f"key {key_id} has {open_rows} requests open{counted}, its limit of {limit} concurrent "
                          "requests (a request of n choices counts n)", retry_after_s=1.0)


def _tokens_refusal(key_id: str, limit: int, used: int, held: int, asked: int, words: tuple[str, str],
                    until_period_end: float) -> Refusal:
    when, name = words
    if used >= limit:
        return Refusal(reason=f"key {key_id} used {used} tokens {when}, its {name} of {limit}",
                       retry_after_s=until_period_end)
    left = max(limit - used - held, 0)
    if asked > limit:
        return Refusal(reason=f"key {key_id}: this request reserves {asked} tokens (its prompt and max_tokens), more "
                              f"than its {name} of {limit}: send a smaller max_tokens", retry_after_s=until_period_end)
    if used + asked > limit:  # it would not fit even once the open requests end
        return Refusal(reason=f"key {key_id} has {limit - used} tokens left {when} of its {name} of {limit}, and this "
                              f"request reserves {asked} (its prompt and max_tokens): send a smaller max_tokens, or "
                              f"try again when its {name} resets", retry_after_s=until_period_end)
    return Refusal(reason=f"key {key_id} has {left} tokens of its {name} of {limit} left {when} besides the {held} its "
                          f"open requests reserve, and this request reserves {asked} (its prompt and max_tokens): "
                          "try again when they end, or send a smaller max_tokens", retry_after_s=1.0)


def requests_in_window(window: KeyWindow, at: float) -> list[float]:
    return [t for t in window.requests if t > at - WINDOW_S]


def minute_tokens(window: KeyWindow, at: float) -> int:
    return window.minute_tokens if window.minute == int(at // 60) else 0


def next_minute(at: float) -> float:
    return (int(at // 60) + 1) * 60.0


def _next_day(at: float) -> float:
    return (int(at // 86400) + 1) * 86400.0


def _next_month(at: float) -> float:
    """The first second of the next UTC month."""
    year, month = (int(part) for part in month_of(at).split("-"))
    year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return days_from_civil(year, month, 1) * 86400.0


def window_after(window: KeyWindow, key: ApiKey, at: float) -> KeyWindow:
    """The window once a request of the key was admitted at `at`: only its limit's worth kept."""
    keep = key.limits.requests_per_minute
    requests = [*requests_in_window(window, at), at][-keep:] if keep else []
    return msgspec.structs.replace(window, requests=requests)


def window_with_tokens(window: KeyWindow, started_at: float, tokens: int) -> KeyWindow:
    """A finished request's tokens, counted in the minute it started (a later minute's start resets it)."""
    minute = int(started_at // 60)
    if minute < window.minute:
        return window
    counted = window.minute_tokens if minute == window.minute else 0
    return msgspec.structs.replace(window, minute=minute, minute_tokens=counted + tokens)
