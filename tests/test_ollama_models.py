"""Ollama's /api/pull, /api/delete and /api/ps's sizes: on plain data (the progress lines), then
with Ollama's own client against `exo` as a process whose fake Hub serves the tiny model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import msgspec
import ollama
import pytest

from exo.api.ollama.models import current_progress, file_lines, pull_error
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import DownloadProgress, FileProgress, NodeInfo
from tests.support.cluster import state_of
from tests.support.e2e import one_model_node, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

MODEL = ModelId("org/m")
A, B = NodeId("a"), NodeId("b")


def progress(node_id: NodeId, status: str = "downloading", error: str = "", **files: tuple[int, int]) -> DownloadProgress:
    return DownloadProgress(node_id=node_id, model_id=MODEL, status=status, error=error,  # type: ignore[arg-type]
                            files=[FileProgress(path=p.replace("_", "."), done=d, total=t) for p, (d, t) in files.items()])


def state_with(*downloads: DownloadProgress, nodes: tuple[NodeId, ...] = (A, B)) -> State:
    by_node: dict[NodeId, dict[ModelId, DownloadProgress]] = {}
    for d in downloads:
        by_node.setdefault(d.node_id, {})[d.model_id] = d
    return State(nodes={n: NodeInfo(node_id=n) for n in nodes}, downloads=by_node)


def digest(path: str) -> str:
    return "sha256:" + hashlib.sha256(f"{MODEL}/{path}".encode()).hexdigest()


def test_each_file_is_one_layer_line_with_its_bytes_summed_over_the_nodes():
    now = {A: progress(A, config_json=(10, 10), model_safetensors=(300, 1000)),
           B: progress(B, model_safetensors=(50, 1000)), NodeId("c"): None}
    assert file_lines(MODEL, now) == [
        {"status": f"pulling {digest('config.json')[7:19]}", "digest": digest("config.json"), "total": 10,
         "completed": 10},
        {"status": f"pulling {digest('model.safetensors')[7:19]}", "digest": digest("model.safetensors"),
         "total": 2000, "completed": 350},
    ]


def test_a_failure_from_before_the_pull_is_not_this_pull_s_failure():
    old = progress(A, "failed", "disk full")
    before = {A: old, B: None}
    assert current_progress(state_with(old), MODEL, before) == {A: None, B: None}  # A is trying again
    assert pull_error(MODEL, {A: None, B: None}, before) is None
    again = msgspec.structs.replace(old, error="disk still full")
    now = current_progress(state_with(again), MODEL, before)
    assert now == {A: again, B: None}
    assert pull_error(MODEL, now, before) == "pulling 'org/m' failed on node a: disk still full"
    done = progress(A, "completed")
    assert current_progress(state_with(done), MODEL, {A: done}) == {A: done}  # already there: done at once


def test_a_node_that_left_is_not_waited_for_and_all_gone_is_an_error():
    before = {A: None, B: None}
    assert current_progress(state_with(progress(B), nodes=(B,)), MODEL, before) == {B: progress(B)}
    assert current_progress(state_with(nodes=()), MODEL, before) == {}
    assert pull_error(MODEL, {}, before) == "the nodes pulling 'org/m' left the cluster (a, b)"
    assert pull_error(MODEL, {A: progress(A, "cancelled")}, before) == \
        "pulling 'org/m' failed on node a: the download of 'org/m' was cancelled"


# Against an exo process: the tiny model from its fake Hub, pulled, placed, listed, deleted.

model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


def node_id_of(http: httpx.Client) -> NodeId:
    return NodeId(http.get("/node_id").json())


@pytest.mark.slow
def test_pull_ps_and_delete_with_ollama_s_client(node, http, llama, model_dir):
    with pytest.raises(ollama.ResponseError) as unknown:
        llama.delete(TINY_MODEL_ID)  # neither a card nor files yet
    assert unknown.value.status_code == 404 and unknown.value.error == f"model '{TINY_MODEL_ID}' not found"

    parts = list(llama.pull(TINY_MODEL_ID, stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"], statuses
    download = state_of(node).download_of(node_id_of(http), TINY_MODEL_ID)
    assert download is not None and download.status == "completed"
    last = {p.digest: p for p in parts if p.digest}  # each file's latest line
    files = {f.path: f for f in download.files}
    assert sorted(last) == sorted("sha256:" + hashlib.sha256(f"{TINY_MODEL_ID}/{f}".encode()).hexdigest()
                                  for f in files)
    assert all(p.status == f"pulling {p.digest[7:19]}" and p.completed == p.total for p in last.values())
    assert sorted(p.total for p in last.values()) == sorted(f.total for f in files.values())
    assert sum(p.total for p in last.values()) == download.total_bytes > 0
    assert TINY_MODEL_ID in state_of(node).custom_model_cards  # added as POST /models/add would
    assert llama.pull(TINY_MODEL_ID).status == "success"  # already there: one object, no stream

    instance_id = place(http, TINY_MODEL_ID)
    shards = state_of(node).instances[instance_id].shards
    running = {m.model: m for m in llama.ps().models}
    held = sum(s.memory_bytes + s.kv_bytes for s in shards)
    assert held > sum(s.memory_bytes for s in shards) > 0
    assert running[TINY_MODEL_ID].size_vram == running[TINY_MODEL_ID].size == held

    with pytest.raises(ollama.ResponseError) as loaded:
        llama.delete(TINY_MODEL_ID)
    assert loaded.value.status_code == 409 and "is loaded" in loaded.value.error
    assert http.delete(f"/instance/{instance_id}").status_code == 200
    assert llama.delete(TINY_MODEL_ID).status == "success"
    state = state_of(node)
    assert state.download_of(node_id_of(http), TINY_MODEL_ID) is None
    assert TINY_MODEL_ID not in state.custom_model_cards and not Path(download.path).exists()
    with pytest.raises(ollama.ResponseError) as gone:
        llama.delete(TINY_MODEL_ID)
    assert gone.value.status_code == 404


@pytest.mark.slow
def test_pulling_what_the_hub_does_not_have_is_a_404_before_any_progress(llama, http):
    with pytest.raises(ollama.ResponseError) as missing:
        list(llama.pull("nobody/nothing", stream=True))
    assert missing.value.status_code == 404, missing.value.error
    with pytest.raises(ollama.ResponseError) as bare:
        llama.pull("llama3.2")  # an Ollama library name: not a Hub repository
    assert bare.value.status_code == 404 and "Hugging Face repository id" in bare.value.error
    assert "nobody/nothing" not in [m.model for m in llama.list().models]
