"""Usage per API key: requests, tokens and audio seconds by model and UTC day, folded from the log
(a task's creation counts the request, its end the tokens and a transcription's audio), so `exo
replay` recomputes exactly what GET /usage and /metrics say. Days are computed from the task's
own time (the API's clock when it was asked), never from a clock here.

State keeps `DAYS_KEPT` days per key (a monthly quota looks back a month at most) and each key's
totals since it began, for /metrics' counters.
"""

from __future__ import annotations

import msgspec

DAYS_KEPT = 62


class UsageCounts(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    audio_seconds: float = 0.0  # completed transcriptions' audio (its length as the API measured it), and speech generated

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(requests=self.requests + other.requests,
                           prompt_tokens=self.prompt_tokens + other.prompt_tokens,
                           completion_tokens=self.completion_tokens + other.completion_tokens,
                           cached_tokens=self.cached_tokens + other.cached_tokens,
                           audio_seconds=self.audio_seconds + other.audio_seconds)


# key id -> UTC day ("2026-12-05") -> model id -> counts
UsageByDay = dict[str, dict[str, dict[str, UsageCounts]]]


def counted(usage: UsageByDay, key_id: str, at: float, model_id: str, add: UsageCounts) -> UsageByDay:
    """A copy of `usage` with `add` counted for the key on `at`'s day; its days past DAYS_KEPT go."""
    day = day_of(at)
    days = dict(usage.get(key_id, {}))
    models = dict(days.get(day, {}))
    models[model_id] = models.get(model_id, UsageCounts()).plus(add)
    days[day] = models
    if len(days) > DAYS_KEPT:
        for old in sorted(days)[:-DAYS_KEPT]:
            del days[old]
    return {**usage, key_id: days}


def tokens_in_day(usage: UsageByDay, key_id: str, at: float) -> int:
    return sum(c.tokens for c in usage.get(key_id, {}).get(day_of(at), {}).values())


def tokens_in_month(usage: UsageByDay, key_id: str, at: float) -> int:
    month = month_of(at)
    return sum(c.tokens for day, models in usage.get(key_id, {}).items() if day.startswith(month)
               for c in models.values())


def day_of(at: float) -> str:
    year, month, day = civil_from_days(int(at // 86400))
    return f"{year:04d}-{month:02d}-{day:02d}"


def month_of(at: float) -> str:
    return day_of(at)[:7]


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a count of days since 1970-01-01 (Howard Hinnant's algorithm)."""
    days += 719468
    era = days // 146097
    day_of_era = days - era * 146097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36524 - day_of_era // 146096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    month_index = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * month_index + 2) // 5 + 1
    month = month_index + 3 if month_index < 10 else month_index - 9
    return year_of_era + era * 400 + (month <= 2), month, day


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (the inverse of civil_from_days)."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468
