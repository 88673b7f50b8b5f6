"""The model catalogue every service reads: the built-in cards plus State's custom ones."""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.adapters import Adapter, split_adapter_id
from exo.core.ids import ModelId
from exo.core.state import State
from exo.core.types import ModelCard


def find_card(state: State, builtin_cards: Mapping[ModelId, ModelCard], model_id: ModelId) -> ModelCard | None:
    """A custom card of that id wins over a built-in one. "<base>:<adapter>" is served by its base's card."""
    card = state.custom_model_cards.get(model_id) or builtin_cards.get(model_id)
    if card is None and (adapter := adapter_of(state, model_id)) is not None:
        return state.custom_model_cards.get(adapter.base_model) or builtin_cards.get(adapter.base_model)
    return card


def adapter_of(state: State, model_id: ModelId) -> Adapter | None:
    """The adapter "<base>:<adapter>" names, if State has one of that name for that base."""
    base, name = split_adapter_id(model_id)
    adapter = state.adapters.get(name) if name else None
    return adapter if adapter is not None and adapter.base_model == base else None


def is_vision_config(config: object) -> bool:
    """A vision-language checkpoint's config.json, as transformers and mlx-vlm write them: a nested
    `vision_config` (Qwen2-VL, LLaVA, Gemma 3, ...). Such a model takes images and runs on mlx-vlm."""
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def is_speech_to_text_config(config: object) -> bool:
    """A Whisper checkpoint's config.json (transformers' layout, or mlx-audio's with `model_type`):
    it turns audio into text and runs on mlx-audio."""
    return isinstance(config, dict) and config.get("model_type") == "whisper"


# The config.json `model_type`s of mlx-audio's text-to-speech families (mlx_audio/tts/models and its
# MODEL_REMAPPING, mlx-audio 0.6). Not the families whose checkpoints say "llama" or "qwen3" (Orpheus,
# VyvoTTS): mlx-audio tells those from chat models by their repository's name, which exo does not.
TEXT_TO_SPEECH_TYPES = frozenset({
    "arktts", "audiodit", "bark", "breeze", "breeze-tts", "breeze_tts", "chatterbox", "chatterbox_turbo", "csm", "dia",
    "dramabox-tts", "echo_tts", "fish_drama3", "gradium_phonon_tts", "higgs_audio", "indextts", "irodori_tts", "kitten",
    "kitten_tts", "kokoro", "kugelaudio", "lingv3_tts", "longcat_audiodit", "marvis", "melotts", "moss_tts_delay",
    "moss_tts_local", "moss_tts_nano", "omnivoice", "outetts", "pocket_tts", "qwen3_tts", "sesame", "soprano", "spark",
    "vibevoice_streaming", "voxcpm", "voxcpm1.5", "voxcpm2", "voxtral_tts", "zonos2"})


def is_text_to_speech_config(config: object) -> bool:
    """A checkpoint of an mlx-audio text-to-speech family, by its config.json's `model_type`: it turns
    text into speech and runs on mlx-audio."""
    return isinstance(config, dict) and config.get("model_type") in TEXT_TO_SPEECH_TYPES
