"""Who may sign a task's token chunks, read from State (pure): the nodes of the instance that runs
the chunk's run (every rank: whichever publishes), each with the public key it registered.

An unsigned chunk is accepted only from a run that a node without a key takes part in (an older
node, mid-upgrade): a forger cannot open that door by registering a keyless node of its own,
since it is not in the run's instance, nor by registering a real node again without its key,
since the first key stays (exo/core/apply.py). See docs/deploy.md, "Per-node identities".
"""

from __future__ import annotations

from exo.core.ids import NodeId, TaskId
from exo.core.state import State


def run_signers(state: State, task_id: TaskId, attempt: int) -> dict[NodeId, str] | None:
    """The nodes that may sign run `attempt` of the task, each to its public key ("": it has none);
    None while State does not show that run yet (this node's view lags the runner's)."""
    task = state.tasks.get(task_id)
    if task is None or attempt < 0 or attempt > len(task.migrations):
        return None
    nodes = task.run_nodes[attempt] if attempt < len(task.run_nodes) else []
    if not nodes and attempt == len(task.migrations):  # not recorded (a group's log holds no instances): its instance
        instance = state.instances.get(task.instance_id)
        nodes = [shard.node_id for shard in instance.shards] if instance is not None else []
    if not nodes and attempt < len(task.migrations):
        # An earlier run never recorded, its instance gone: any node of the cluster, still by its own key.
        return {node_id: node.public_key for node_id, node in state.nodes.items()} or None
    if not nodes:
        return None
    earlier = attempt < len(task.migrations)
    return {node: _key_of(state, node) or (_revoked_key(state, node) if earlier else "") for node in nodes}


def may_run_unseen(state: State, signer: str, signed: bool) -> bool:
    """Whether a chunk of a run State does not show yet may be real, and so is worth waiting for:
    an instance exists before any run starts on it, so its signer is a node of one of State's
    instances (unsigned: one without a key). Anything else is dropped at once, so a forgery
    claiming a later run cannot stall the stream behind it."""
    nodes = {shard.node_id for instance in state.instances.values() for shard in instance.shards}
    if not signed:
        return any(not _key_of(state, node) for node in nodes)
    return NodeId(signer) in nodes and bool(_key_of(state, NodeId(signer)))


def _key_of(state: State, node_id: NodeId) -> str:
    node = state.nodes.get(node_id)
    return node.public_key if node is not None else ""


def _revoked_key(state: State, node_id: NodeId) -> str:
    """A removed node's key verifies the runs it ran before its removal (a resume reads them), none after."""
    revoked = state.revoked_nodes.get(node_id)
    return revoked.public_key if revoked is not None else ""


def chunk_refusal(signers: dict[NodeId, str], signer: str, signed: bool) -> str:
    """Why a chunk claiming `signer` may not pass ("" : it may, once its signature verifies
    against signers[signer] when `signed`)."""
    if not signed:
        if any(not key for key in signers.values()):
            return ""  # a node of this run predates keys: its chunks come unsigned
        return "unsigned, but every node of this run has a key"
    if NodeId(signer) not in signers:
        return f"node {signer or '(none named)'} does not run this run of the task (its nodes: {', '.join(sorted(signers))})"
    if not signers[NodeId(signer)]:
        return f"node {signer} has no public key in State"
    return ""
