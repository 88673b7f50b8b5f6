"""Prefill on one instance, decode on another: which instance decodes a request, and which one
computes its prompt's KV cache for it (pure).

An instance placed with `role: "decode"` decodes; one with `role: "prefill"` computes prompts'
KV caches, which its runner sends to the decoding runner directly (exo/runner/prefill_peer.py);
"both" (the default) does both, alone. The master's decision is the task's `prefill_instance`;
the bytes never pass through NATS. Fallbacks, each exact (the decode side prefills as a single
instance would): no prefill instance ready, a request a prefill instance cannot take (images, an
adapter), a decode side without room (a prefill instance then decodes it alone).
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.ids import InstanceId, ModelId
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import Instance


def decoders(with_room: list[Instance]) -> list[Instance]:
    """The instances that may decode the request: every one but the prefill instances, unless
    those are all that has room (the fallback: a prefill instance decodes alone)."""
    decoding = [i for i in with_room if i.role != "prefill"]
    return decoding or with_room


def decode_fallback_note(chosen: Instance, serving: list[Instance]) -> str:
    """Why `chosen`, a prefill instance, decodes a request alone; "" when it is no prefill instance."""
    if chosen.role != "prefill":
        return ""
    why = "every decode instance is full" if any(i.role == "decode" for i in serving) else \
        "no decode instance of the model is serving"
    return f"decoded on prefill instance {chosen.instance_id}, alone: {why}"


def prefill_instance_for(state: State, chosen: Instance, candidates: list[Instance], params: GenerationParams,
                         model_id: ModelId, open_rows: Mapping[InstanceId, int]) -> InstanceId:
    """The prefill instance that computes the prompt's cache for `chosen`, a decode instance; ""
    where none may: it prefills alone. `candidates`: the model's serving instances."""
    if chosen.role != "decode" or model_id != chosen.model_id or _has_images(params) or not _keyed(state, chosen):
        return InstanceId("")  # an adapter's rows (model_id is "<base>:<adapter>") or images: prefilled where they decode
    prefilling = [i for i in candidates
                  if i.role == "prefill" and i.model_id == chosen.model_id and i.kv_bits == chosen.kv_bits
                  and len(i.shards) == 1 and _serves_prefills(state, i) and _keyed(state, i)]
    if not prefilling:
        return InstanceId("")
    asked = _prefills_asked(state)
    return min(prefilling, key=lambda i: (asked.get(i.instance_id, 0) + open_rows.get(i.instance_id, 0),
                                          i.created_seq)).instance_id


def _has_images(params: GenerationParams) -> bool:
    return any(message.images for message in params.messages)


def _keyed(state: State, instance: Instance) -> bool:
    """Its node has a key in State: both halves sign what they send (an older node has none)."""
    node = state.nodes.get(instance.shards[0].node_id) if instance.shards else None
    return node is not None and bool(node.public_key)


def _serves_prefills(state: State, instance: Instance) -> bool:
    runner = state.runners.get(instance.shards[0].runner_id)
    return runner is not None and runner.status == "ready" and bool(runner.prefill_address)


def _prefills_asked(state: State) -> dict[InstanceId, int]:
    """Pending tasks by the prefill instance they ask: the work each prefill instance has coming."""
    asked: dict[InstanceId, int] = {}
    for tasks in state.open_tasks_by_instance().values():
        for task in tasks:
            if task.prefill_instance and task.status == "pending":
                asked[task.prefill_instance] = asked.get(task.prefill_instance, 0) + 1
    return asked
