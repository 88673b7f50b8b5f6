"""The worker's image cache on plain files: least recently used out first, within a byte limit,
never what an open task of this node needs; the order survives a restart (mtimes)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from exo.core.apply import apply
from exo.core.events import InstanceCreated, InstanceDeleted, TaskCreated, TaskFinished, TaskMigrated, TaskStarted
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import Instance, ShardAssignment, Task
from exo.settings.declare import read
from exo.settings.services import WorkerSettings
from exo.worker.image_cache import ImageCache
from exo.worker.plan import WorkerView, images_needed, images_of_waiting_tasks, tasks_needing
from tests.support.as_master import stamped, with_leader


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


A, B, C, D = (digest(n) for n in "abcd")


def write(cache: ImageCache, name: str, size: int = 100) -> None:
    """What the worker does after a verified fetch."""
    cache.directory.mkdir(parents=True, exist_ok=True)
    cache.path(name).write_bytes(b"x" * size)
    cache.add(name, size)


def on_disk(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_least_recently_used_goes_first_and_a_use_makes_an_image_the_last(tmp_path):
    cache = ImageCache(tmp_path, limit_bytes=300)
    for name in (A, B, C):
        write(cache, name)
    assert cache.trim(needed=set()) == []  # at the limit: nothing goes
    cache.touch([A])  # handed to a runner: now the most recent
    write(cache, D)
    assert cache.order() == [B, C, A, D]
    assert cache.trim(needed=set()) == [B]
    assert cache.digests() == {C, A, D} == on_disk(tmp_path)


def test_the_byte_limit_holds_after_each_trim(tmp_path):
    cache = ImageCache(tmp_path, limit_bytes=1000)
    for n in range(20):
        write(cache, digest(str(n)), size=150 + n)
        cache.trim(needed=set())
        assert cache.total_bytes <= 1000
        assert cache.total_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert cache.order() == [digest(str(n)) for n in range(14, 20)]  # the six newest fit
    write(cache, A, size=5000)  # one image over the whole limit, needed by nobody: it goes too
    assert A in cache.trim(needed=set()) and cache.total_bytes <= 1000


def test_images_an_open_task_needs_are_never_evicted(tmp_path):
    cache = ImageCache(tmp_path, limit_bytes=250)
    for name in (A, B, C):
        write(cache, name)
    assert cache.trim(needed={A}) == [B]  # A is the oldest but needed: the next one goes
    assert cache.order() == [A, C]


def test_needed_images_over_the_limit_all_stay_and_that_is_logged(tmp_path, caplog):
    cache = ImageCache(tmp_path, limit_bytes=150)
    for name in (A, B, C):
        write(cache, name)
    with caplog.at_level(logging.WARNING, logger="exo.worker.image_cache"):
        assert cache.trim(needed={A, B}) == [C]
    assert cache.digests() == {A, B} == on_disk(tmp_path) and cache.total_bytes == 200
    assert "over the limit of 150" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exo.worker.image_cache"):
        assert cache.trim(needed={A, B}) == []  # still over: said once, not at every plan
    assert caplog.text == ""
    assert cache.trim(needed=set()) == [A]  # their tasks ended: back within the limit
    assert cache.digests() == {B}


def test_startup_scan_orders_by_mtime_drops_half_written_files_and_skips_strangers(tmp_path):
    for age, name in enumerate((C, A, B)):  # C oldest
        (tmp_path / name).write_bytes(b"y" * 100)
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    (tmp_path / f".{D}.tmp").write_bytes(b"half")
    (tmp_path / "README").write_text("not an image")
    cache = ImageCache(tmp_path, limit_bytes=200)
    assert cache.order() == [C, A, B] and cache.total_bytes == 300
    assert not (tmp_path / f".{D}.tmp").exists()
    assert cache.trim(needed=set()) == [C]
    assert (tmp_path / "README").exists()


def test_a_use_survives_a_restart(tmp_path):
    cache = ImageCache(tmp_path, limit_bytes=10_000)
    for age, name in enumerate((A, B)):
        write(cache, name)
        os.utime(cache.path(name), (1_000_000 + age, 1_000_000 + age))
    cache.touch([A])
    assert ImageCache(tmp_path, limit_bytes=10_000).order() == [B, A]


def test_a_missing_folder_is_an_empty_cache(tmp_path):
    cache = ImageCache(tmp_path / "images", limit_bytes=10)
    assert cache.digests() == frozenset() and cache.trim(needed=set()) == []


def test_the_limit_comes_from_the_environment():
    assert read(WorkerSettings, {}).image_cache_bytes == 1 << 30
    assert read(WorkerSettings, {"EXO_IMAGE_CACHE_BYTES": "12345"}).image_cache_bytes == 12345


MINE = Instance(instance_id="i1", model_id="m/a", shards=[ShardAssignment(runner_id="r1", node_id="me")])
THEIRS = Instance(instance_id="i2", model_id="m/a", shards=[ShardAssignment(runner_id="r2", node_id="other")])


def task(task_id: str, instance_id: str, *images: str) -> Task:
    params = GenerationParams(messages=[ChatMessage(role="user", content="look", images=list(images))])
    return Task(task_id=task_id, instance_id=instance_id, model_id="m/a", params=params)


def test_needed_means_the_images_of_this_nodes_pending_and_running_tasks():
    state = with_leader()
    for event in (InstanceCreated(instance=MINE), InstanceCreated(instance=THEIRS),
                  TaskCreated(task=task("pending", "i1", A)), TaskCreated(task=task("running", "i1", B)),
                  TaskStarted(task_id="running"), TaskCreated(task=task("elsewhere", "i2", C))):
        state = apply(state, stamped(state, event), state.last_seq + 1)
    view = WorkerView(node_id="me", state=state)
    assert images_needed(view) == {A, B}
    # A failed fetch fails this node's pending tasks that need the image, once; never another node's.
    assert tasks_needing(view, A) == ["pending"]
    assert tasks_needing(view, C) == []
    assert tasks_needing(WorkerView(node_id="me", state=state, ended_tasks=frozenset({"pending"})), A) == []


def test_a_late_joiner_also_fetches_the_images_of_tasks_waiting_for_a_lost_instance():
    # While a worker was down its instance was deleted and its task waits for the desire's
    # replacement (instance ""), which may be placed on this node once it is back: it fetches the
    # image before it plans, not after the replacement comes.
    state = with_leader()
    for event in (InstanceCreated(instance=MINE), InstanceCreated(instance=THEIRS),
                  TaskCreated(task=task("waits", "i1", A, B)), TaskCreated(task=task("served", "i2", C)),
                  TaskCreated(task=task("done", "i1", D)), TaskFinished(task_id="done", status="completed"),
                  TaskMigrated(task_id="waits", to_instance="", reason="instance i1: node lost", at=1.0),
                  InstanceDeleted(instance_id="i1", reason="node lost")):
        state = apply(state, stamped(state, event), state.last_seq + 1)
    view = WorkerView(node_id="me", state=state, local_images=frozenset({B}))
    assert images_of_waiting_tasks(view) == [A]  # not B (here), C (served elsewhere), D (finished)
    assert images_of_waiting_tasks(WorkerView(node_id="me", state=state, images_in_flight=frozenset({A}))) == [B]
    assert images_of_waiting_tasks(WorkerView(node_id="me", state=state, ended_tasks=frozenset({"waits"}))) == []


def test_a_write_is_whole_or_leaves_nothing(tmp_path):
    cache = ImageCache(tmp_path / "images", 1_000)
    cache.write("a" * 64, b"x" * 10)
    assert (tmp_path / "images" / ("a" * 64)).read_bytes() == b"x" * 10 and cache.total_bytes == 10
    (tmp_path / "images" / ("b" * 64)).mkdir()  # the name is taken by a folder: the rename fails
    (tmp_path / "images" / ("b" * 64) / "x").write_bytes(b"")
    try:
        cache.write("b" * 64, b"y" * 20)
    except OSError:
        pass
    else:
        raise AssertionError("the write should have failed")
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["a" * 64, "b" * 64]  # no .tmp left
    assert "b" * 64 not in cache and cache.total_bytes == 10
