"""The size rules of placement and of adding a card: an unknown size is refused unless forced,
sizes read in people's units, and a card's size is what mlx-lm loads, never a repository's spare copies."""

from __future__ import annotations

import json

import pytest

from exo.core.placement import Unplaceable, human_bytes, needed_and_free, place_instance, placement_previews
from exo.core.types import ModelCard
from exo.models.card_facts import MAX_META_FILE_BYTES, NoWeights, local_card_facts, weight_bytes
from tests.test_placement import CARD, GB, cluster_of, ids, layout, node, place


def test_a_model_of_unknown_size_is_refused_unless_forced():
    unknown = ModelCard(model_id="org/m", n_layers=8)
    refused = place(card=unknown, state=cluster_of(node("n1", 1)))
    assert isinstance(refused, Unplaceable) and refused.code == "conflict"
    assert refused.reason.startswith("the size of org/m is unknown (its card has no storage_bytes)")
    assert '"force": true' in refused.reason
    forced = place_instance(unknown, "pipeline", 1, cluster_of(node("n1", 1)), ids(), force=True)
    assert layout(forced) == [("n1", 0, 1, 0, 8, "")]  # forced: the size does not constrain
    assert all(p.rejection == refused for p in placement_previews(unknown, cluster_of(node("n1", 1))))
    assert all(p.instance for p in placement_previews(unknown, cluster_of(node("n1", 1)), force=True)
               if p.node_count == 1)
    too_big = place_instance(CARD, "pipeline", 1, cluster_of(node("n1", GB)), ids(), force=True)
    assert layout(too_big) == [("n1", 0, 1, 0, 8, "")] and too_big.shards[0].memory_bytes == 8 * GB  # still recorded


def test_sizes_read_in_peoples_units():
    assert [human_bytes(n) for n in (229 * GB, 23_100_000_000, 512 * 10**6, 999_600_000, 4 * 10**12, 999)] == [
        "229 GB", "23.1 GB", "512 MB", "1.0 GB", "4.0 TB", "1.0 kB"]
    assert needed_and_free(8 * GB, 7 * GB) == ("8.0 GB", "7.0 GB")
    assert needed_and_free(8 * GB, 7_990_000_000) == ("8.00 GB", "7.99 GB")  # never "needs 8.0 GB, has 8.0 GB"
    assert needed_and_free(8 * GB, 8 * GB - 1) == ("8000000000 bytes", "7999999999 bytes")


def test_a_cards_size_is_what_mlx_lm_loads():
    sizes = {"model.safetensors": 100, "consolidated.safetensors": 100, "original/model.safetensors": 100,
             "config.json": 5}
    assert weight_bytes(sizes, None) == 100  # top-level model*.safetensors only, as mlx-lm globs
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    sharded = {"model-00001-of-00002.safetensors": 70, "model-00002-of-00002.safetensors": 30,
               "consolidated.safetensors": 100}
    assert weight_bytes(sharded, index) == 100  # the files the index names, each once
    with pytest.raises(NoWeights, match="mlx_lm.convert"):
        weight_bytes({"pytorch_model.bin": 100, "config.json": 5}, None)


@pytest.mark.parametrize("index", ["[]", '{"weight_map": []}', '{"weight_map": {"a": [1]}}', '{"weight_map": {"a": 5}}',
                                   '{"weight_map": "x"}', "nan", "{}"])
def test_a_hostile_index_is_refused_with_the_reason_not_a_crash(index):
    with pytest.raises(NoWeights):
        weight_bytes({"model.safetensors": 5}, index)


def test_a_config_far_larger_than_a_models_is_refused_unread(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"0" * 10)
    with open(tmp_path / "config.json", "wb") as config:
        config.truncate(MAX_META_FILE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(NoWeights, match="config.json is"):
        local_card_facts(tmp_path)
