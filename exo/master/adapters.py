"""The master's decisions about LoRA adapters: adding one, and deleting one, which waits for the
requests that use it. Pure, like exo/master/decide.py, which hands these commands here.

DELETE of an adapter that open requests (running, or queued for an instance) name marks it
(`adapter.deleting`): from then on a request naming it is refused as if it were unknown (404, as
vLLM answers for an unloaded LoRA adapter and OpenAI for a deleted fine-tuned model), those already
accepted run to their end, and the master's supervision appends `adapter.deleted` once the last one
ends (`deletions_due`). The mark is in State, so a new master after a failover finishes the job.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec.structs import replace

from exo.core.adapter_use import open_requests_of
from exo.core.adapters import misfit
from exo.core.catalogue import find_card
from exo.core.commands import AddAdapter, DeleteAdapter, command_tag
from exo.core.events import AdapterAdded, AdapterDeleted, AdapterDeleting, CommandRejected, Event
from exo.core.ids import ModelId
from exo.core.state import State
from exo.core.types import ModelCard, RejectionCode


def add_adapter(state: State, command: AddAdapter, builtin: Mapping[ModelId, ModelCard]) -> list[Event]:
    adapter = replace(command.adapter, deleting=False)  # only a DELETE marks one
    if problem := adapter.problem():
        return _reject(command, "invalid", problem)
    card = find_card(state, builtin, adapter.base_model)
    if card is None or card.model_id != adapter.base_model:  # an adapter fits a model, not another adapter
        return _reject(command, "not_found", f"unknown base model {adapter.base_model!r}")
    if problem := misfit(adapter, card):
        return _reject(command, "invalid", problem)
    existing = state.adapters.get(adapter.name)
    if existing is not None and existing.deleting:
        return _reject(command, "conflict", f"adapter {adapter.name!r} is being deleted once the requests that use it "
                                            "end; add it again after that")
    if existing is not None and replace(existing, source=adapter.source) != adapter:
        return _reject(command, "conflict", f"an adapter named {adapter.name!r} exists already (for "
                                            f"{existing.base_model}, weights {existing.digest[:12]}); delete it "
                                            "first or choose another name")
    return [AdapterAdded(command_id=command.command_id, adapter=existing or adapter)]


def delete_adapter(state: State, command: DeleteAdapter) -> list[Event]:
    """Deleted now when no open request names it; else marked, and deleted when the last one ends."""
    adapter = state.adapters.get(command.name)
    if adapter is None:
        return _reject(command, "not_found", f"unknown adapter {command.name!r}")
    if state.instances_of(adapter.model_id) or any(d.model_id == adapter.model_id for d in state.desires.values()):
        return _reject(command, "conflict", f"{adapter.model_id!r} has instances placed; delete them first")
    if open_requests_of(state, adapter.model_id):  # served on its base's instance, or waiting for one
        return [AdapterDeleting(command_id=command.command_id, name=command.name)]
    return [AdapterDeleted(command_id=command.command_id, name=command.name)]


def deletions_due(state: State) -> list[Event]:
    """The adapters marked for deletion that no open request names any more: deleted now."""
    return [AdapterDeleted(name=name) for name, adapter in sorted(state.adapters.items())
            if adapter.deleting and not open_requests_of(state, adapter.model_id)]


def orphan_weights(state: State, stored: Mapping[str, float], now: float, grace_s: float) -> list[str]:
    """The objects of exo-adapters (sha256 -> when written, epoch seconds) that no adapter in State
    names and that were written more than `grace_s` ago: weights whose deletion was lost (the API
    node that would have removed them stopped first) or whose upload never became an adapter. The
    grace spares an upload whose AddAdapter is still on its way."""
    named = {adapter.digest for adapter in state.adapters.values()}
    return sorted(digest for digest, written in stored.items() if digest not in named and now - written > grace_s)


def _reject(command: AddAdapter | DeleteAdapter, code: RejectionCode, reason: str) -> list[Event]:
    return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code=code, reason=reason)]
