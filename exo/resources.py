"""Where the files that ship beside the code live: stream definitions and built-in cards.

In a checkout (and with `uv run`) they are the repo's top-level folders; in a wheel they are
packaged under exo/_data. EXO_STREAMS_DIR / EXO_CARDS_DIR override both.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str, env: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    for candidate in (_PACKAGE.parent / name, _PACKAGE / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cannot find the {name}/ folder (set {env})")


def streams_dir() -> Path:
    return _find("streams", "EXO_STREAMS_DIR")


def builtin_cards_dir() -> Path:
    return _find("cards", "EXO_CARDS_DIR")
