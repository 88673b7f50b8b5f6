"""What the master keeps from one decision to the next to save time. decide() takes it and decides
exactly as it would without: each part is a cache over State, checked against the State it is given."""

from __future__ import annotations

from exo.core.ids import InstanceId, ModelId
from exo.core.state import State
from exo.core.types import Instance, RunnerInfo
from exo.master.routing import TaskIndex


class ServingInstances:
    """Each model's instances, placement order, and those with a failed runner, as of one State's
    `instances` and `runners`. Both change far less often than requests come (a placement, a
    runner's status): the answers are kept until either is another object. The reducer copies a
    container before changing it (Draft.own), so the containers of one State never change; holding
    them here also keeps their ids from being reused."""

    def __init__(self) -> None:
        self._instances: object = None
        self._runners: object = None
        self._by_model: dict[ModelId, tuple[list[Instance], dict[InstanceId, RunnerInfo]]] = {}

    def of(self, state: State, model_id: ModelId) -> tuple[list[Instance], dict[InstanceId, RunnerInfo]]:
        if state.instances is not self._instances or state.runners is not self._runners:
            self._instances, self._runners, self._by_model = state.instances, state.runners, {}
        found = self._by_model.get(model_id)
        if found is None:
            instances = state.instances_of(model_id)
            failed = {i.instance_id: runner for i in instances if (runner := failed_runner(state, i)) is not None}
            found = self._by_model[model_id] = (instances, failed)
        return found


def failed_runner(state: State, instance: Instance) -> RunnerInfo | None:
    runners = (state.runners.get(shard.runner_id) for shard in instance.shards)
    return next((r for r in runners if r is not None and r.status == "failed"), None)


class DecideMemo:
    def __init__(self) -> None:
        self.tasks = TaskIndex()
        self.serving = ServingInstances()
