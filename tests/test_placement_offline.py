"""Placement and offline nodes (`exo --offline`), on plain data: an offline node fetches no model,
from the Hub or from peers, so placement prefers nodes that can get the files, leaves out an
offline node known to lack them, and names such nodes when it refuses."""

import msgspec

from exo.core.placement import Unplaceable, place_instance, placement_previews
from exo.core.state import State
from exo.core.types import DownloadProgress, Instance, ModelCard, NodeInfo
from exo.worker.node_info import NodeIdentity, describe_this_node
from tests.test_placement import CARD, GB, ids, layout, node

WHY_OFFLINE = ("offline (--offline) without org/m on disk, and an offline node fetches no model, from the Hub or "
               "from peers; copy it into a model directory there and ask that node to download it "
               "(POST /download/start finds the copy), or start a node without --offline")


def offline(info: NodeInfo) -> NodeInfo:
    return msgspec.structs.replace(info, offline=True)


def with_downloads(*nodes: NodeInfo, **status_of: str) -> State:
    """State with these nodes and, per node id, the status of its download of CARD's model."""
    downloads = {n: {CARD.model_id: DownloadProgress(node_id=n, model_id=CARD.model_id, status=s)}
                 for n, s in status_of.items()}
    return State(nodes={n.node_id: n for n in nodes}, downloads=downloads)


def nodes_of(placed: Instance | Unplaceable) -> list[str]:
    assert isinstance(placed, Instance), placed
    return [s.node_id for s in placed.shards]


def test_an_offline_node_without_the_model_loses_to_a_node_that_can_download_it():
    # The incident: n1 died; n2 (offline, no copy it ever reported) has more free memory than n3.
    state = with_downloads(node("n1", 64 * GB), offline(node("n2", 32 * GB)), node("n3", 16 * GB))
    placed = place_instance(CARD, "pipeline", 1, state, ids(), exclude=frozenset({"n1"}))
    assert nodes_of(placed) == ["n3"]


def test_an_offline_node_that_reported_the_model_is_as_good_as_any():
    state = with_downloads(offline(node("n2", 32 * GB)), node("n3", 16 * GB), n2="completed")
    assert nodes_of(place_instance(CARD, "pipeline", 1, state, ids())) == ["n2"]  # most free memory wins


def test_offline_nodes_that_may_hold_an_unreported_copy_are_still_used_when_no_other_can():
    alone = with_downloads(offline(node("n2", 32 * GB)))  # an offline cluster: its models were never reported
    assert nodes_of(place_instance(CARD, "pipeline", 1, alone, ids())) == ["n2"]
    # n3 can fetch but holds only 6 of the 8 GB: one node still beats two, so the offline one takes it whole.
    spill = with_downloads(offline(node("n2", 32 * GB)), node("n3", 6 * GB))
    assert layout(place_instance(CARD, "pipeline", 1, spill, ids())) == [("n2", 0, 1, 0, 8, "")]


def test_offline_nodes_whose_try_failed_are_left_out_and_named_when_none_is_left():
    state = with_downloads(offline(node("n2", 32 * GB)), offline(node("n3", 16 * GB)), n2="failed", n3="failed")
    assert place_instance(CARD, "pipeline", 1, state, ids()) == Unplaceable(
        "unavailable", f"no node can get org/m: n2, n3 run {WHY_OFFLINE}")
    assert [p.rejection for p in placement_previews(CARD, state)] == [
        Unplaceable("unavailable", f"no node can get org/m: n2, n3 run {WHY_OFFLINE}")] * 2


def test_a_refusal_for_the_nodes_left_names_the_offline_node_left_out():
    state = with_downloads(offline(node("n2", 32 * GB)), node("n3", 6 * GB), n2="failed")
    assert place_instance(CARD, "pipeline", 1, state, ids()) == Unplaceable(
        "conflict", f"org/m needs 8.0 GB; the node with the most free memory (n3, 6.0 GB free) cannot hold it; "
                    f"n2 runs {WHY_OFFLINE}")
    assert place_instance(CARD, "pipeline", 2, state, ids()) == Unplaceable(
        "conflict", f"min_nodes=2 but the cluster has 1 usable node(s); n2 runs {WHY_OFFLINE}")
    [pipeline, tensor] = placement_previews(CARD, state)  # one node left to preview on, per sharding
    assert pipeline.rejection is not None and pipeline.rejection.reason.endswith(f"n2 runs {WHY_OFFLINE}")
    assert (pipeline.node_count, tensor.node_count) == (1, 1)


def test_a_model_at_a_local_path_needs_no_fetch_so_an_offline_node_may_take_it():
    local = ModelCard(model_id="org/m", n_layers=8, storage_bytes=8 * GB, path="/models/m")
    state = with_downloads(offline(node("n2", 32 * GB)), node("n3", 16 * GB), n2="failed")
    assert nodes_of(place_instance(local, "pipeline", 1, state, ids())) == ["n2"]


def test_previews_prefer_the_node_that_can_download_as_placing_does():
    state = with_downloads(offline(node("n2", 32 * GB)), node("n3", 16 * GB))
    one_node = [p for p in placement_previews(CARD, state) if p.node_count == 1]
    assert [nodes_of(p.instance) for p in one_node if p.instance] == [["n3"], ["n3"]]


def test_a_node_says_it_is_offline_in_what_it_tells_placement():
    said = describe_this_node("n1", "inc", 0.0, identity=NodeIdentity(offline=True))
    assert said.offline is True
    assert describe_this_node("n1", "inc", 0.0).offline is False
    assert msgspec.json.decode(b'{"node_id": "n1"}', type=NodeInfo).offline is False  # an older node's report
