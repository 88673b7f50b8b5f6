"""The master's decision on `exo node remove` (RemoveNode): the node's instances end the way a
timed-out node's do (exo/master/supervise.py: their generations move to other instances), then
`node.removed` takes it out of State for good (exo/core/revocation.py). Pure, like
exo/master/decide.py, which hands the command here."""

from __future__ import annotations

from exo.core.commands import RemoveNode, command_tag
from exo.core.events import CommandRejected, Event, NodeRemoved
from exo.core.node_names import node_display
from exo.core.state import State
from exo.master.heal import HealLimits
from exo.master.supervise import end_instances_on


def remove_node(state: State, command: RemoveNode, limits: HealLimits = HealLimits()) -> list[Event]:
    node = state.nodes.get(command.node_id)
    if node is None:
        revoked = state.revoked_nodes.get(command.node_id)
        why = f"node {command.node_id} was removed already (event {revoked.seq})" if revoked else \
            f"unknown node {command.node_id!r}"
        return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code="not_found",
                                reason=why)]
    reason = (f"node {node_display(state, command.node_id)} was removed by {command.removed_by or 'an admin'}"
              f"{': ' + command.reason if command.reason else ''}")
    return [*end_instances_on(state, command.node_id, reason, command.at, limits),
            NodeRemoved(command_id=command.command_id, node_id=command.node_id, public_key=node.public_key,
                        reason=command.reason, removed_by=command.removed_by)]
