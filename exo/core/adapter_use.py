"""What State says about an adapter's use: the open requests that name it, whether it is being
deleted (waiting for them: exo/master/adapters.py), whether another adapter shares its weights."""

from __future__ import annotations

from exo.core.adapters import Adapter
from exo.core.catalogue import adapter_of
from exo.core.ids import ModelId
from exo.core.state import State

OPEN = ("pending", "running")


def open_requests_of(state: State, model_id: ModelId) -> int:
    """Requests for the model not ended yet: running, queued on an instance, or waiting for one."""
    return sum(1 for t in state.tasks.values() if t.model_id == model_id and t.status in OPEN)


def being_deleted(state: State, model_id: ModelId) -> str:
    """Why a new request or placement for "<base>:<adapter>" is refused ("": it is not)."""
    adapter = adapter_of(state, model_id)
    if adapter is None or not adapter.deleting:
        return ""
    return (f"unknown model {model_id!r}: adapter {adapter.name!r} is being deleted (it takes no new requests; "
            "the ones it is running end first)")


def weights_shared(state: State, adapter: Adapter) -> bool:
    """Whether another adapter uses these weights: then they stay in the object store."""
    return any(a.digest == adapter.digest and a.name != adapter.name for a in state.adapters.values())
