"""The thinking switch of each surface, as one `enable_thinking` for the chat template.

OpenAI chat: `reasoning_effort` ("none" turns thinking off), `chat_template_kwargs.enable_thinking`
(vLLM, llama.cpp) or `enable_thinking`; Responses: `reasoning.effort`; Anthropic: `thinking.type`
("enabled" / "disabled"); Ollama: `think`. None leaves the model's template to its default.
"""

from __future__ import annotations

from typing import Any

from exo.api.errors import ApiError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_TEMPLATE_SWITCHES = ("enable_thinking", "thinking")  # what chat templates call it


def from_effort(effort: str | None, param: str) -> bool | None:
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise ApiError(400, f"{param} must be one of {list(EFFORTS)}, got {effort!r}", param=param)
    return effort != "none"


def from_template_kwargs(kwargs: dict[str, Any] | None) -> bool | None:
    """chat_template_kwargs: only the thinking switch reaches the template (nothing else is passed)."""
    if not kwargs:
        return None
    if unknown := sorted(set(kwargs) - set(_TEMPLATE_SWITCHES)):
        raise ApiError(400, f"chat_template_kwargs: only {list(_TEMPLATE_SWITCHES)} are supported, got {unknown}",
                       param=f"chat_template_kwargs.{unknown[0]}")
    values = {bool(v) if isinstance(v, bool) else v for v in kwargs.values()}
    if len(values) != 1 or not isinstance(next(iter(values)), bool):
        raise ApiError(400, "chat_template_kwargs: the thinking switch must be one true or false",
                       param="chat_template_kwargs")
    return next(iter(values))


def first_of(*switches: bool | None) -> bool | None:
    return next((s for s in switches if s is not None), None)


def from_ollama(think: bool | str | None) -> bool | None:
    if think is None or isinstance(think, bool):
        return think
    return from_effort(think, "think")  # "low" / "medium" / "high": on


def from_anthropic(kind: str | None) -> bool | None:
    if kind is None:
        return None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, "thinking.type must be 'enabled', 'disabled' or 'adaptive'", param="thinking.type")
    return None if kind == "adaptive" else kind == "enabled"  # adaptive: as the model's template decides
