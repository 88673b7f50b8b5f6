"""`Idempotency-Key` on POST /place_instance: a retry (after a 202, a timeout, a dropped
connection) answers with the instance the first try placed instead of placing a second one.

The key becomes the command's id, so the answer lives in the log, not in this process: the
retry may reach any node, after a restart or a change of master. The master decides a command
id once (exo/master/decide.py), and the instance records the command that placed it.
"""

from __future__ import annotations

import hashlib
import re

from aiohttp import web

from exo.api.errors import ApiError
from exo.core.ids import CommandId, ModelId
from exo.core.state import State
from exo.core.types import Instance

HEADER = "Idempotency-Key"
_KEY = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no spaces: what clients send (UUIDs mostly)


def command_id_for(request: web.Request) -> CommandId | None:
    """The command id a request's key stands for (None: no key, place afresh)."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not _KEY.fullmatch(key):
        raise ApiError(400, f"{HEADER} must be 1 to 255 printable ASCII characters without spaces", param=HEADER)
    return CommandId("idem-" + hashlib.sha256(key.encode()).hexdigest()[:40])


def earlier_placement(state: State, command_id: CommandId, model_id: ModelId) -> Instance | None:
    """The instance an earlier request with this key placed; None if the key is new.

    The instances are looked at first: State remembers only the latest answered commands, and a
    key must keep finding its instance for as long as the instance lives."""
    instance = next((i for i in state.instances.values() if i.command_id == command_id), None)
    if instance is None and command_id not in state.answered_commands:
        return None
    if instance is None:
        raise ApiError(409, f"this {HEADER} was used by a placement that was refused or whose instance has been "
                            "deleted since; send a new key to place again", param=HEADER, code="idempotency_key_used")
    if instance.model_id != model_id:
        raise ApiError(422, f"this {HEADER} placed {instance.model_id!r}, not {model_id!r}: a key stands for one "
                            "request", param=HEADER, code="idempotency_key_reused")
    return instance
