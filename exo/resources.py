"""Where the files that ship beside the code live: stream definitions and built-in cards.

In a checkout (and with `uv run`) they are the repo's top-level folders; in a wheel they are
packaged under exo/_data. EXO_STREAMS_DIR / EXO_CARDS_DIR override both: the one place that
reads settings from the environment itself, because the operator tools and the node both need
these folders before any settings are passed around.
"""

from __future__ import annotations

from pathlib import Path

from exo.settings.declare import read
from exo.settings.services import ResourceSettings

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str, override: str, env: str) -> Path:
    if override:
        return Path(override)
    for candidate in (_PACKAGE.parent / name, _PACKAGE / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cannot find the {name}/ folder (set {env})")


def streams_dir() -> Path:
    return _find("streams", read(ResourceSettings).streams_dir, "EXO_STREAMS_DIR")


def builtin_cards_dir() -> Path:
    return _find("cards", read(ResourceSettings).cards_dir, "EXO_CARDS_DIR")
