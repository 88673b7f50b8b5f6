"""The pure parts of downloads on plain data: which files a shard needs, where a download goes,
retry timing, progress arithmetic, the reducer's download cases, and which peers to ask."""

import shutil
from pathlib import Path

import pytest

from exo.core.apply import apply
from exo.core.events import DownloadDeleted, DownloadFailed, DownloadProgressed, InstanceCreated, TaskCreated
from exo.core.state import State
from exo.core.types import DownloadProgress, FileProgress, Instance, ModelCard, ShardAssignment, Task
from exo.models.dirs import LEGACY_MARKER, DownloadSettings, ModelDirs, choose_target, dir_name, find_complete, write_manifest
from exo.models.files import FileMeta, Manifest, is_safe_path, layer_files, missing, needed_files, rebase, with_verified
from exo.models.progress import RetryPolicy, next_delay, speed, summarize
from exo.settings.declare import read
from exo.settings.services import ModelSettings
from exo.worker.downloads import peers_with
from exo.worker.plan import EndTask, LocalRunner, WorkerView, plan
from tests.support.as_master import stamped, with_leader

WEIGHT_MAP = {
    "model.embed_tokens.weight": "a.safetensors",
    "model.layers.0.mlp.weight": "a.safetensors",
    "model.layers.1.mlp.weight": "b.safetensors",
    "model.layers.2.mlp.weight": "b.safetensors",
    "model.layers.3.mlp.weight": "c.safetensors",
    "model.norm.weight": "d.safetensors",
    "lm_head.weight": "d.safetensors",
}
PATHS = ["config.json", "tokenizer.json", "chat_template.jinja", "README.md", "modeling.py", "model.safetensors.index.json",
         "a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors", "original/consolidated.pth"]
SUPPORT = ["chat_template.jinja", "config.json", "model.safetensors.index.json", "tokenizer.json"]


def test_a_shard_needs_its_layers_files_and_those_of_no_layer():
    index = {"weight_map": WEIGHT_MAP}
    assert layer_files(WEIGHT_MAP, 1, 3) == {"a.safetensors", "b.safetensors", "d.safetensors"}
    assert needed_files(PATHS, index, 0, 1) == sorted([*SUPPORT, "a.safetensors", "d.safetensors"])
    assert needed_files(PATHS, index, 3, 4) == sorted([*SUPPORT, "a.safetensors", "c.safetensors", "d.safetensors"])
    # A shard of unknown size, or a model without an index, takes every weight file; never code or README.
    everything = sorted([*SUPPORT, "a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"])
    assert needed_files(PATHS, index, 0, 0) == everything
    assert needed_files(PATHS, None, 0, 2) == everything


def test_rebase_keeps_only_local_files_the_source_still_has_the_same():
    source = Manifest(repo_id="o/m", commit="c2", files={
        "a": FileMeta(size=3, sha256="x"), "b": FileMeta(size=4, git_oid="g"), "c": FileMeta(size=5, sha256="z"),
    })
    local = Manifest(repo_id="o/m", commit="c1", files={
        "a": FileMeta(size=3, sha256="x"), "b": FileMeta(size=4, sha256="s", git_oid="g"), "c": FileMeta(size=5, sha256="old"),
    }, verified=["a", "b", "c"])
    rebased = rebase(local, source)
    assert rebased.commit == "c2" and rebased.verified == ["a", "b"]
    assert rebased.files["b"] == FileMeta(size=4, sha256="s", git_oid="g")  # our computed sha256 stays for peers
    assert missing(with_verified(rebased, "c", FileMeta(size=5, sha256="z")), ["a", "b", "c"]) == []
    assert rebase(None, source).verified == []


def test_paths_from_a_source_must_stay_inside_the_model_directory():
    assert [p for p in ["a.json", "sub/b.json", "../x", "/etc/passwd", "a/../../x", "a//b", "./a", "a\\b", ""]
            if is_safe_path(p)] == ["a.json", "sub/b.json"]
    hostile = Manifest(repo_id="o/m", files={"../../.bashrc": FileMeta(size=1), "config.json": FileMeta(size=2)})
    assert list(rebase(None, hostile).files) == ["config.json"]


def test_the_target_is_a_directory_already_holding_the_model_else_the_first_with_room(tmp_path: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    dirs = ModelDirs(writable=(one, two))
    free = {one: 100, two: 1000}
    assert choose_target(dirs, "o/m", 50, free.__getitem__) == one / "o--m"
    assert choose_target(dirs, "o/m", 500, free.__getitem__) == two / "o--m"
    assert choose_target(dirs, "o/m", 500, free.__getitem__, reserve=600) is None
    (two / "o--m").mkdir(parents=True)
    assert choose_target(dirs, "o/m", 50, free.__getitem__) == two / "o--m"  # resume where it started


def test_models_dirs_from_the_environment(tmp_path: Path):
    env = {"EXO_MODELS_DIRS": f"{tmp_path / 'a'}:{tmp_path / 'b'}", "EXO_MODELS_READ_ONLY_DIRS": str(tmp_path / "ro"),
           "EXO_MODEL_SHARING": "0"}
    settings = DownloadSettings.of(read(ModelSettings, env), tmp_path / "data")
    assert settings.dirs == ModelDirs(writable=(tmp_path / "a", tmp_path / "b"), read_only=(tmp_path / "ro",))
    assert settings.share is False and settings.offline is False
    default = DownloadSettings.of(read(ModelSettings, {"HF_HUB_OFFLINE": "1"}), tmp_path / "data")
    assert default.dirs.writable == (tmp_path / "data" / "models",) and default.offline and default.share
    with pytest.raises(ValueError):
        dir_name("../etc")


def test_a_manifest_says_complete_only_when_every_needed_file_is_verified_and_intact(tmp_path: Path):
    card = ModelCard(model_id="o/m")
    model = tmp_path / "models" / "o--m"
    model.mkdir(parents=True)
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    for name, data in files.items():
        (model / name).write_bytes(data)
    listing = {name: FileMeta(size=len(data)) for name, data in files.items()}
    dirs = ModelDirs(writable=(tmp_path / "models",))
    write_manifest(model, Manifest(repo_id="o/m", files=listing, verified=["config.json"]))
    assert find_complete(dirs, card, 0, 0) is None
    write_manifest(model, Manifest(repo_id="o/m", files=listing, verified=sorted(files)))
    copy = find_complete(dirs, card, 0, 0)
    assert copy is not None and copy.path == model and copy.files == {"config.json": 2, "model.safetensors": 7}
    assert find_complete(dirs, ModelCard(model_id="o/m", revision="v2"), 0, 0) is None  # another revision
    (model / "model.safetensors").write_bytes(b"short")  # changed behind our back
    assert find_complete(dirs, card, 0, 0) is None


def test_a_full_download_by_an_earlier_exo_still_counts_and_a_bare_folder_does_not(tmp_path: Path):
    model = tmp_path / "models" / "o--m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    dirs = ModelDirs(writable=(tmp_path / "models",))
    assert find_complete(dirs, ModelCard(model_id="o/m"), 0, 0) is None  # no manifest, no marker: unknown
    (model / LEGACY_MARKER).write_text("main")
    copy = find_complete(dirs, ModelCard(model_id="o/m"), 0, 0)
    assert copy is not None and copy.files == {"config.json": 2, "model.safetensors": 7} and copy.writable


def test_read_only_directories_are_searched_in_three_layouts(tmp_path: Path):
    card = ModelCard(model_id="o/m")
    dirs = ModelDirs(writable=(tmp_path / "rw",), read_only=(tmp_path / "ro",))
    cache = tmp_path / "ro" / "models--o--m"
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("abc123")
    for layout in [tmp_path / "ro" / "o--m", tmp_path / "ro" / "o" / "m", cache / "snapshots" / "abc123"]:
        layout.mkdir(parents=True)
        (layout / "config.json").write_text("{}")
        (layout / "model.safetensors").write_bytes(b"w")
        copy = find_complete(dirs, card, 0, 0)
        assert copy is not None and (copy.path, copy.writable) == (layout, False)
        shutil.rmtree(layout)
    assert find_complete(dirs, card, 0, 0) is None


def test_retries_are_bounded_back_off_and_honour_retry_after():
    policy = RetryPolicy(attempts=4, base_delay_s=0.5, max_delay_s=1.5, max_retry_after_s=60)
    assert [next_delay(policy, n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, None]
    assert next_delay(policy, 1, retry_after_s=7) == 7
    assert next_delay(policy, 1, retry_after_s=3600) is None  # a wait that long is a failure to report
    assert next_delay(policy, 4, retry_after_s=1) is None


def test_progress_sums_files_and_measures_speed_over_recent_samples():
    files = {"b": (50, 100), "a": (100, 100)}
    samples = [(0.0, 0), (9.0, 100), (10.0, 150)]
    assert speed(samples, now=10.0) == 50.0  # only the last five seconds count
    progress = summarize("n1", "o/m", "downloading", files, samples, now=10.0, source="hub", path="/m")
    assert progress == DownloadProgress(
        node_id="n1", model_id="o/m", status="downloading", done_bytes=150, total_bytes=200, speed_bps=50.0, eta_s=1.0,
        files=[FileProgress(path="a", done=100, total=100), FileProgress(path="b", done=50, total=100)],
        source="hub", path="/m", updated_at=10.0,
    )
    assert summarize("n1", "o/m", "downloading", files, samples[:1], now=10.0).eta_s is None  # speed unknown yet
    assert summarize("n1", "o/m", "completed", files, samples, now=10.0).speed_bps == 0.0


def _fold(*events, state: State | None = None) -> State:
    state = with_leader(state)
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def test_reducer_keeps_the_latest_download_record_per_node_and_model():
    first = DownloadProgress(node_id="n1", model_id="o/m", status="downloading", done_bytes=10, total_bytes=100)
    state = _fold(DownloadProgressed(progress=first),
                  DownloadProgressed(progress=DownloadProgress(node_id="n2", model_id="o/m", status="completed")))
    assert state.download_of("n1", "o/m") == first and state.download_of("n2", "o/m").status == "completed"
    failed = _fold(DownloadFailed(node_id="n1", model_id="o/m", code="network", reason="gave up", at=5.0), state=state)
    record = failed.download_of("n1", "o/m")
    assert (record.status, record.error_code, record.error, record.done_bytes, record.updated_at) == (
        "failed", "network", "gave up", 10, 5.0)  # what was on disk stays known
    deleted = _fold(DownloadDeleted(node_id="n1", model_id="o/m"), state=failed)
    assert list(deleted.downloads) == ["n2"] and not deleted.skipped_events
    again = _fold(DownloadDeleted(node_id="n1", model_id="o/m"), state=deleted)
    assert again.downloads == deleted.downloads and "no download of o/m" in again.skipped_events[-1].reason
    unknown = _fold(DownloadFailed(node_id="n3", model_id="x/y", code="not_found", reason="404"))
    assert unknown.download_of("n3", "x/y").status == "failed"


def test_peers_are_other_nodes_with_a_complete_copy():
    state = _fold(*(DownloadProgressed(progress=DownloadProgress(node_id=n, model_id="o/m", status=s))
                    for n, s in [("me", "completed"), ("b", "completed"), ("a", "completed"), ("c", "downloading")]))
    assert peers_with(state, "o/m", "me") == ["a", "b"]
    assert peers_with(state, "o/other", "me") == []


def test_tasks_of_a_runner_whose_download_failed_end_with_the_reason():
    instance = Instance(instance_id="i1", model_id="o/m", shards=[ShardAssignment(runner_id="r1", node_id="me")])
    state = _fold(InstanceCreated(instance=instance), TaskCreated(task=Task(task_id="t1", instance_id="i1", model_id="o/m")))
    failed = LocalRunner(runner_id="r1", instance_id="i1", phase="failed", error="download failed: repository not found")
    assert plan(WorkerView(node_id="me", state=state, runners={"r1": failed})) == [EndTask(
        task_id="t1", status="failed", reason="the runner serving it failed: download failed: repository not found")]
