"""Where each model is (`ready_on`, `downloaded_on` in /v1/models and /api/tags), from hand-made
States: a model is ready on the nodes of its ready instances only (a failed or loading one does
not count) and downloaded where its download completed; nodes by name, and by id beside. The routes,
on a real node: see tests/test_dashboard.py."""

from __future__ import annotations

from exo.api.cluster.models import NOWHERE, availability, openai_entry
from exo.core.state import State
from exo.core.types import DownloadProgress, Instance, ModelCard, NodeInfo, RunnerInfo, ShardAssignment

A, B = "model/a", "model/b"


def instance(instance_id: str, model_id: str, ranks: dict[str, str], max_context: int = 0) -> tuple[Instance, list[RunnerInfo]]:
    """An instance with one rank per node, each runner in the status given (node id -> status)."""
    shards = [ShardAssignment(runner_id=f"{instance_id}-r{n}", node_id=node, rank=n, world_size=len(ranks))
              for n, node in enumerate(ranks)]
    runners = [RunnerInfo(runner_id=s.runner_id, instance_id=instance_id, node_id=s.node_id, status=status)  # type: ignore[arg-type]
               for s, status in zip(shards, ranks.values(), strict=True)]
    return Instance(instance_id=instance_id, model_id=model_id, shards=shards, max_context=max_context), runners


def state_of(*parts: tuple[Instance, list[RunnerInfo]], downloads: list[DownloadProgress] = ()) -> State:
    found: dict = {}
    for record in downloads:
        found.setdefault(record.node_id, {})[record.model_id] = record
    nodes = {n: NodeInfo(node_id=n, name=f"mac-{n}") for n in ("n1", "n2", "n3")}  # n4: gone from State
    return State(nodes=nodes, instances={i.instance_id: i for i, _ in parts},
                 runners={r.runner_id: r for _, runners in parts for r in runners}, downloads=found)


def test_ready_means_every_runner_of_an_instance_is_ready():
    state = state_of(instance("i1", A, {"n2": "ready", "n1": "ready"}),
                     instance("i2", A, {"n3": "loading"}),
                     instance("i3", B, {"n1": "ready", "n2": "failed"}))
    where = availability(state)
    assert (where[A].ready_on_ids, where[A].ready_on) == (["n1", "n2"], ["mac-n1", "mac-n2"])
    assert B not in where  # its only instance failed: on no node


def test_downloaded_means_a_completed_download():
    state = state_of(downloads=[
        DownloadProgress(node_id="n1", model_id=A, status="completed"),
        DownloadProgress(node_id="n4" * 8, model_id=A, status="completed"),
        DownloadProgress(node_id="n2", model_id=A, status="downloading"),
        DownloadProgress(node_id="n3", model_id=B, status="failed", error_code="not_found"),
    ])
    where = availability(state)
    assert (where[A].ready_on, where[A].downloaded_on) == ([], ["mac-n1", "n4n4n4n4"])  # a gone node: its short id
    assert where[A].downloaded_on_ids == ["n1", "n4" * 8]
    assert B not in where


def test_the_openai_entry_keeps_its_fields_and_adds_where():
    card = ModelCard(model_id=A, name="A", context_length=4096)
    state = state_of(instance("i1", A, {"n1": "ready"}, max_context=2048),
                     downloads=[DownloadProgress(node_id="n1", model_id=A, status="completed")])
    assert openai_entry(card, state, availability(state)[A]) == {
        "id": A, "object": "model", "created": 0, "owned_by": "exo", "name": "A", "context_length": 4096,
        "max_context": 2048, "ready_on": ["mac-n1"], "downloaded_on": ["mac-n1"], "ready_on_ids": ["n1"],
        "downloaded_on_ids": ["n1"]}
    other = ModelCard(model_id=B)
    assert openai_entry(other, state, NOWHERE) == {
        "id": B, "object": "model", "created": 0, "owned_by": "exo", "name": B, "context_length": 0,
        "max_context": None, "ready_on": [], "downloaded_on": [], "ready_on_ids": [], "downloaded_on_ids": []}
