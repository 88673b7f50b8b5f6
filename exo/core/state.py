"""The one State every node folds the event log into."""

from __future__ import annotations

import msgspec

from exo.core.types import Instance, ModelCard, NodeInfo, RunnerInfo, Task

MAX_SKIPPED_KEPT = 100
MAX_FINISHED_TASKS = 1000


class SkippedEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    reason: str


class State(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int = 0  # stream sequence of the last event folded in
    nodes: dict[str, NodeInfo] = {}
    instances: dict[str, Instance] = {}
    runners: dict[str, RunnerInfo] = {}
    tasks: dict[str, Task] = {}
    custom_model_cards: dict[str, ModelCard] = {}
    skipped_events: list[SkippedEvent] = []  # the most recent events the reducer could not use

    def instances_of(self, model_id: str) -> list[Instance]:
        return sorted(
            (i for i in self.instances.values() if i.model_id == model_id),
            key=lambda i: (i.created_seq, i.instance_id),
        )

    def open_tasks_of(self, instance_id: str) -> list[Task]:
        return [
            t for t in self.tasks.values() if t.instance_id == instance_id and t.status in ("pending", "running")
        ]


_state_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(State)


def encode_state(state: State) -> bytes:
    return _state_encoder.encode(state)


def decode_state(data: bytes) -> State:
    return _state_decoder.decode(data)
