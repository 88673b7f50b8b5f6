"""Small range checks every surface shares; each raises a 400 naming the parameter."""

from __future__ import annotations

from typing import TypeVar

from exo.api.errors import ApiError

N = TypeVar("N", int, float)


def in_range(value: N | None, low: N, high: N, param: str) -> N | None:
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{param} must be between {low} and {high}, got {value}", param=param)
    return value


def at_least_one(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param)
    return value


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
