"""The model catalogue every service reads: the built-in cards plus State's custom ones."""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.ids import ModelId
from exo.core.state import State
from exo.core.types import ModelCard


def find_card(state: State, builtin_cards: Mapping[ModelId, ModelCard], model_id: ModelId) -> ModelCard | None:
    """A custom card of that id wins over a built-in one."""
    return state.custom_model_cards.get(model_id) or builtin_cards.get(model_id)


def is_vision_config(config: object) -> bool:
    """A vision-language checkpoint's config.json, as transformers and mlx-vlm write them: a nested
    `vision_config` (Qwen2-VL, LLaVA, Gemma 3, ...). Such a model takes images and runs on mlx-vlm."""
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)
