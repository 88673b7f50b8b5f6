"""Model cards on disk: built-in cards (read-only TOML) and this node's custom-card folder.

Cards decode strictly (a typo is an error). Custom cards live in State; the folder is a
copy that `reconcile_custom_cards` keeps equal to it, never touching built-in cards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import msgspec
import tomlkit

from exo.core.ids import ModelId
from exo.core.types import ModelCard, is_valid_model_id

log = logging.getLogger(__name__)


class CardError(ValueError):
    pass


def card_file_name(model_id: ModelId) -> str:
    if not is_valid_model_id(model_id):
        raise CardError(f"invalid model id {model_id!r}")
    return model_id.replace("/", "--") + ".toml"


def read_card(path: Path) -> ModelCard:
    try:
        card = msgspec.convert(tomlkit.parse(path.read_text()).unwrap(), ModelCard)
    except (msgspec.ValidationError, tomlkit.exceptions.TOMLKitError) as error:
        raise CardError(f"{path}: {error}") from error
    if not is_valid_model_id(card.model_id):
        raise CardError(f"{path}: invalid model id {card.model_id!r}")
    return card


def load_builtin_cards(folder: Path) -> dict[ModelId, ModelCard]:
    cards = [read_card(p) for p in sorted(folder.glob("*.toml"))]
    return {c.model_id: c for c in cards}


def card_to_toml(card: ModelCard) -> str:
    fields = msgspec.to_builtins(card)
    defaults = msgspec.to_builtins(ModelCard(model_id=card.model_id))
    document = tomlkit.document()
    for key, value in fields.items():
        if key == "model_id" or value != defaults.get(key):
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if v is not None}
            document[key] = value
    return tomlkit.dumps(document)


def reconcile_custom_cards(folder: Path, cards: Mapping[ModelId, ModelCard]) -> None:
    """Make `folder` hold exactly `cards`: write missing or changed ones, delete the rest.
    O(cards): for a node starting up; a live node follows one card at a time with `reconcile_custom_card`."""
    folder.mkdir(parents=True, exist_ok=True)
    valid = {model_id: card for model_id, card in cards.items() if card.problem() is None}
    for model_id in cards.keys() - valid.keys():  # from a State written before the reducer refused them
        log.warning("custom card %r is invalid (%s): not written", model_id, cards[model_id].problem())
    wanted = {card_file_name(c.model_id): c for c in valid.values()}
    for path in folder.glob("*.toml"):
        if path.name not in wanted:
            path.unlink()
    for name, card in wanted.items():
        _write_if_changed(folder / name, card_to_toml(card))


def reconcile_custom_card(folder: Path, model_id: ModelId, card: ModelCard | None) -> None:
    """Make `folder` agree with State about one card: write it if missing or changed, delete
    its file if State no longer has it. Touches one file, whatever the number of cards.
    An invalid id (an event the reducer skipped) names no file: nothing to do."""
    if not is_valid_model_id(model_id):
        return
    path = folder / card_file_name(model_id)
    if card is None:
        path.unlink(missing_ok=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    _write_if_changed(path, card_to_toml(card))


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(text)
        temporary.replace(path)
