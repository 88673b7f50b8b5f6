"""Where each model can be used now: the nodes with a ready instance of it, and those that downloaded it.

Shared by the surfaces that list models (exo's /v1/models, Ollama's /api/tags). Nodes are listed
by name (`ready_on`, `downloaded_on`: exo/core/node_names.py) for people, and by id
(`ready_on_ids`, `downloaded_on_ids`, in the same order) for programs that look them up in State."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.ids import ModelId, NodeId
from exo.core.node_names import node_display
from exo.core.state import State


class Availability(msgspec.Struct, frozen=True, kw_only=True):
    """Where a model is now: node ids sorted, and the nodes' names in the same order."""

    ready_on_ids: list[NodeId] = []  # nodes with a rank of an instance whose every runner is ready
    downloaded_on_ids: list[NodeId] = []  # nodes whose download of the model completed
    ready_on: list[str] = []
    downloaded_on: list[str] = []

    def fields(self) -> dict[str, Any]:
        return {"ready_on": list(self.ready_on), "downloaded_on": list(self.downloaded_on),
                "ready_on_ids": list(self.ready_on_ids), "downloaded_on_ids": list(self.downloaded_on_ids)}


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
    return {model_id: _where(state, sorted(ready.get(model_id, ())), sorted(downloaded.get(model_id, ())))
            for model_id in ready.keys() | downloaded.keys()}


def _where(state: State, ready: list[NodeId], downloaded: list[NodeId]) -> Availability:
    return Availability(ready_on_ids=ready, downloaded_on_ids=downloaded,
                        ready_on=[node_display(state, n) for n in ready],
                        downloaded_on=[node_display(state, n) for n in downloaded])
