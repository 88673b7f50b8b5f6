"""The exact edges of a key's limits, against the pure admission function with the time passed in:
a request exactly 60 s old has left the requests-per-minute window (59.999 s old has not), and a
key that used exactly its daily or monthly quota is refused the next request."""

from __future__ import annotations

import calendar

import pytest

from exo.core.keys import WINDOW_S, ApiKey, KeyLimits, KeyWindow, Refusal, admission, requests_in_window

KEY = ApiKey(key_id="key_0123456789abcdef", secret_sha256="a" * 64)
T0 = float(calendar.timegm((2026, 6, 15, 12, 0, 0)))  # mid-month, mid-day: no period ends nearby


def admit(limits: KeyLimits, *, requests: list[float] | None = None, used_day: int = 0, used_month: int = 0,
          at: float = T0) -> Refusal | None:
    key = ApiKey(key_id=KEY.key_id, secret_sha256=KEY.secret_sha256, limits=limits)
    return admission(key, KeyWindow(requests=requests or []), 0, used_day, used_month, at)


def test_a_request_exactly_a_window_old_has_left_it():
    assert WINDOW_S == 60.0
    assert requests_in_window(KeyWindow(requests=[T0]), T0 + 60.0) == []
    assert admit(KeyLimits(requests_per_minute=1), requests=[T0], at=T0 + 60.0) is None


def test_a_request_a_millisecond_younger_than_the_window_still_counts():
    assert requests_in_window(KeyWindow(requests=[T0]), T0 + 59.999) == [T0]
    refusal = admit(KeyLimits(requests_per_minute=1), requests=[T0], at=T0 + 59.999)
    assert refusal is not None and "made 1 requests in the last minute" in refusal.reason
    assert refusal.retry_after_s == pytest.approx(0.001)


QUOTAS = [(KeyLimits(tokens_per_day=100), "used 100 tokens today (UTC), its daily quota of 100"),
          (KeyLimits(tokens_per_month=100), "used 100 tokens this month (UTC), its monthly quota of 100")]


@pytest.mark.parametrize(("limits", "words"), QUOTAS)
def test_a_quota_used_exactly_refuses_the_next_request(limits, words):
    refusal = admit(limits, used_day=100, used_month=100)
    assert refusal is not None and words in refusal.reason


@pytest.mark.parametrize("limits", [limits for limits, _ in QUOTAS])
def test_a_quota_one_token_short_admits_the_next_request(limits):
    assert admit(limits, used_day=99, used_month=99) is None
