"""Where each model can be used now: the nodes with a ready instance of it, and those that downloaded it.

Shared by the surfaces that list models (exo's /v1/models, Ollama's /api/tags)."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.ids import ModelId, NodeId
from exo.core.state import State


class Availability(msgspec.Struct, frozen=True, kw_only=True):
    """Where a model is now: node ids, sorted."""

    ready_on: list[NodeId] = []  # nodes with a rank of an instance whose every runner is ready
    downloaded_on: list[NodeId] = []  # nodes whose download of the model completed

    def fields(self) -> dict[str, Any]:
        return {"ready_on": list(self.ready_on), "downloaded_on": list(self.downloaded_on)}


NOWHERE = Availability()


def availability(state: State) -> dict[ModelId, Availability]:
    """Every model that is ready or downloaded somewhere; models absent from it are on no node."""
    ready: dict[ModelId, set[NodeId]] = {}
    for instance in state.instances.values():
        if state.is_ready(instance):
            ready.setdefault(instance.model_id, set()).update(s.node_id for s in instance.shards)
    downloaded: dict[ModelId, set[NodeId]] = {}
    for node_id, records in state.downloads.items():
        for model_id, record in records.items():
            if record.status == "completed":
                downloaded.setdefault(model_id, set()).add(node_id)
    return {model_id: Availability(ready_on=sorted(ready.get(model_id, ())),
                                   downloaded_on=sorted(downloaded.get(model_id, ())))
            for model_id in ready.keys() | downloaded.keys()}
