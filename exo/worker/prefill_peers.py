"""Prefill on one instance, decode on another, as a worker sees it (pure): where a decoding runner
asks for a task's prompt cache, and which asker a prefill runner expects (exo/runner/prefill_peer.py).
Both come from State: the master's choice (`Task.prefill_instance`), the prefill runner's address
(its `ready` status) and the nodes' keys (their registrations)."""

from __future__ import annotations

from exo.core.state import State
from exo.core.types import Task
from exo.runner.protocol import ExpectPrefill, PrefillPeer


def prefill_peer_of(state: State, task: Task) -> PrefillPeer | None:
    """The prefill runner a task's first run asks; None: it prefills alone (a moved task resumes
    from its streamed tokens, as every migration does)."""
    instance = state.instances.get(task.prefill_instance) if task.prefill_instance and not task.migrations else None
    if instance is None or len(instance.shards) != 1:
        return None
    shard = instance.shards[0]
    runner, node = state.runners.get(shard.runner_id), state.nodes.get(shard.node_id)
    if runner is None or runner.status != "ready" or not runner.prefill_address or node is None or not node.public_key:
        return None
    return PrefillPeer(address=runner.prefill_address, node_id=shard.node_id, public_key=node.public_key)


def expectation_of(state: State, task: Task) -> ExpectPrefill | None:
    """What a prefill runner is told of a task that asks it: the decoding node and its key."""
    decoding = state.instances.get(task.instance_id)
    if decoding is None or not decoding.shards or task.migrations:
        return None
    asker = decoding.shards[0].node_id
    node = state.nodes.get(asker)
    if node is None or not node.public_key:
        return None
    return ExpectPrefill(task_id=task.task_id, asker=asker, asker_public_key=node.public_key)
