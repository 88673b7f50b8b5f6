"""Download coordinators against the local imitation of the Hub (real HTTP, real files) and a
real nats-server (events in the log, State folded from it, peers over NATS).

Each test runs coordinators in this process, as a worker does; several coordinators with their
own directories and node ids are several nodes. huggingface-hub is pointed at the fake Hub with
its `endpoint` argument, so no environment variable has to be set before its import.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import shutil
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from exo.bus.event_log import EventLog
from exo.bus.peers.download_control import NodeUnreachable, request_download_action
from exo.bus.state_view import StateView
from exo.core.events import DownloadFailed, DownloadProgressed, Event
from exo.core.state import State
from exo.core.types import ModelCard
from exo.models.dirs import PARTIAL_DIR, DownloadSettings, ModelDirs
from exo.models.progress import RetryPolicy
from exo.models.transfer import DownloadCancelled, DownloadError
from exo.worker.downloads import DownloadCoordinator
from tests.conftest import eventually
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model, shard_file

REPO = "exo-test/sharded-llama"
CARD = ModelCard(model_id=REPO, n_layers=2)
SUPPORT = ["config.json", "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json",
           "tokenizer.json", "tokenizer_config.json"]
FIRST, LAYER0, LAYER1 = shard_file(1, 3), shard_file(2, 3), shard_file(3, 3)
FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.2)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_sharded_model(tmp_path_factory.mktemp("hub") / "sharded-llama")


@pytest.fixture
def hub(model: Path):
    with FakeHub({REPO: model}) as fake:
        yield fake


class Cluster:
    """Coordinators ("nodes") on one NATS, sharing one State view of the log."""

    def __init__(self, nc, view: StateView, cards: dict[str, ModelCard]) -> None:
        self.nc, self.view, self.cards = nc, view, cards
        self.coordinators: list[DownloadCoordinator] = []
        self.published: dict[str, list[Event]] = {}

    async def node(self, root: Path, hub: FakeHub | None, node_id: str | None = None, **settings) -> DownloadCoordinator:
        node_id = node_id or uuid.uuid4().hex
        options = {"dirs": ModelDirs(writable=(root / "models",)), "retry": FAST_RETRY,
                   "hub_endpoint": hub.endpoint if hub else "http://127.0.0.1:9", **settings}
        log = EventLog(self.nc)
        tap = self.published.setdefault(node_id, [])

        async def publish(event: Event) -> None:
            tap.append(event)
            await log.append(event, uuid.uuid4().hex)

        coordinator = DownloadCoordinator(nc=self.nc, node_id=node_id, settings=DownloadSettings(**options), publish=publish,
                                          state=lambda: self.view.state, card_of=self.cards.get)
        await coordinator.start()
        self.coordinators.append(coordinator)
        return coordinator

    def record(self, node: DownloadCoordinator, model_id: str = REPO):
        return self.view.state.download_of(node.node_id, model_id)


@pytest_asyncio.fixture
async def cluster(nc):
    view = StateView(nc, State(last_seq=await EventLog(nc).last_sequence()))  # follow from now on
    await view.start()
    cluster = Cluster(nc, view, {REPO: CARD})
    yield cluster
    for coordinator in cluster.coordinators:
        await coordinator.stop()
    await view.stop()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_of(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


async def test_two_pipeline_shards_each_fetch_only_their_weight_files(cluster, hub, model, tmp_path):
    first = await cluster.node(tmp_path / "a", hub, share=False)
    second = await cluster.node(tmp_path / "b", hub, share=False)
    path_a = await first.ensure(CARD, 0, 1)
    path_b = await second.ensure(CARD, 1, 2)
    assert files_of(path_a) - {".exo-manifest.json"} == {*SUPPORT, FIRST, LAYER0}
    assert files_of(path_b) - {".exo-manifest.json"} == {*SUPPORT, FIRST, LAYER1}
    assert hub.downloads == {**{f"{REPO}/{f}": 2 for f in SUPPORT}, f"{REPO}/{FIRST}": 2,
                             f"{REPO}/{LAYER0}": 1, f"{REPO}/{LAYER1}": 1}
    assert all(sha(path_a / f) == sha(model / f) for f in [*SUPPORT, FIRST, LAYER0])
    await eventually(lambda: (r := cluster.record(first)) is not None and r.status == "completed")
    record = cluster.record(first)
    needed = [*SUPPORT, FIRST, LAYER0]
    assert record.done_bytes == record.total_bytes == sum((model / f).stat().st_size for f in needed)
    assert sorted(f.path for f in record.files) == sorted(needed)
    assert (record.source, record.path) == ("hub", str(path_a))
    # The other shard later: only its missing weight file comes over the network.
    assert await first.ensure(CARD, 1, 2) == path_a
    assert hub.downloads[f"{REPO}/{LAYER1}"] == 2 and hub.downloads[f"{REPO}/{FIRST}"] == 2


async def test_a_dropped_connection_resumes_where_it_stopped_and_the_file_verifies(cluster, hub, model, tmp_path):
    hub.drop_after(f"{REPO}/{FIRST}", 50_000)
    node = await cluster.node(tmp_path, hub)
    path = await node.ensure(CARD)
    assert [r for r in hub.ranges if r[0] == f"{REPO}/{FIRST}"] == [(f"{REPO}/{FIRST}", 0), (f"{REPO}/{FIRST}", 50_000)]
    assert sha(path / FIRST) == sha(model / FIRST)
    assert not (path / PARTIAL_DIR / FIRST).exists()


async def test_wrong_bytes_are_detected_and_the_file_fetched_again(cluster, hub, model, tmp_path):
    hub.corrupt(f"{REPO}/{LAYER1}")
    hub.corrupt(f"{REPO}/tokenizer.json")  # a git (non-LFS) file: checked by its git blob id
    node = await cluster.node(tmp_path, hub)
    path = await node.ensure(CARD)
    assert hub.downloads[f"{REPO}/{LAYER1}"] == 2 and hub.downloads[f"{REPO}/tokenizer.json"] == 2
    assert sha(path / LAYER1) == sha(model / LAYER1) and sha(path / "tokenizer.json") == sha(model / "tokenizer.json")


async def test_a_file_that_is_always_wrong_fails_the_download_as_corrupt(cluster, hub, tmp_path):
    hub.corrupt(f"{REPO}/{LAYER0}", times=3)
    node = await cluster.node(tmp_path, hub)
    with pytest.raises(DownloadError) as failure:
        await node.ensure(CARD)
    assert failure.value.code == "corrupt" and "fetched 3 times" in failure.value.reason
    await eventually(lambda: (r := cluster.record(node)) is not None and r.status == "failed")
    assert cluster.record(node).error_code == "corrupt"


async def test_429_waits_as_long_as_retry_after_says(cluster, hub, model, tmp_path):
    hub.rate_limit(f"{REPO}/{FIRST}", retry_after=1)
    node = await cluster.node(tmp_path, hub)
    started = time.monotonic()
    path = await node.ensure(CARD)
    assert time.monotonic() - started >= 1.0  # FAST_RETRY alone would have waited 0.05 s
    assert hub.downloads[f"{REPO}/{FIRST}"] == 1 and sha(path / FIRST) == sha(model / FIRST)


@pytest.mark.parametrize("repos, gated, code, reason", [
    ({}, False, "not_found", f"repository not found on the Hub: {REPO}"),
    (None, True, "gated", f"{REPO} is gated: accept its terms on the Hub and set HF_TOKEN"),
])
async def test_hub_refusals_are_failed_downloads_with_a_reason(cluster, model, tmp_path, repos, gated, code, reason):
    with FakeHub({REPO: model} if repos is None else repos) as hub:
        if gated:
            hub.gated.add(REPO)
        node = await cluster.node(tmp_path, hub)
        with pytest.raises(DownloadError) as failure:
            await node.ensure(CARD)
    assert failure.value.code == code and failure.value.reason.startswith(reason)
    await eventually(lambda: (r := cluster.record(node)) is not None and r.status == "failed")
    assert (cluster.record(node).error_code, cluster.record(node).error) == (code, failure.value.reason)
    assert [type(e) for e in cluster.published[node.node_id]] == [DownloadFailed]


async def test_an_unreachable_hub_fails_after_bounded_retries(cluster, tmp_path):
    node = await cluster.node(tmp_path, None)  # nothing listens on the endpoint
    started = time.monotonic()
    with pytest.raises(DownloadError) as failure:
        await node.ensure(CARD)
    assert failure.value.code == "network" and "gave up after 3 attempts" in failure.value.reason
    assert time.monotonic() - started < 5


async def test_disk_space_is_checked_before_any_file_is_fetched(cluster, hub, tmp_path):
    node = await cluster.node(tmp_path, hub, reserve_bytes=1 << 62)
    with pytest.raises(DownloadError) as failure:
        await node.ensure(CARD)
    assert failure.value.code == "disk_full" and "no model directory has" in failure.value.reason
    assert hub.downloads == {}


async def test_offline_uses_complete_local_models_and_fails_fast_otherwise(cluster, hub, tmp_path):
    online = await cluster.node(tmp_path / "a", hub)
    path = await online.ensure(CARD)
    requests = len(hub.requests)
    offline = await cluster.node(tmp_path / "a", hub, offline=True)
    assert await offline.ensure(CARD) == path
    empty = await cluster.node(tmp_path / "b", hub, offline=True)
    started = time.monotonic()
    with pytest.raises(DownloadError) as failure:
        await empty.ensure(CARD)
    assert failure.value.code == "offline" and f"offline mode: {REPO} is not complete" in failure.value.reason
    assert time.monotonic() - started < 1 and len(hub.requests) == requests  # not one request to the Hub


async def test_a_read_only_directory_is_used_and_never_written_or_deleted(cluster, hub, model, tmp_path):
    read_only = tmp_path / "ro"
    shutil.copytree(model, read_only / "exo-test" / "sharded-llama")  # the <org>/<name> layout
    before = {p: p.stat().st_mtime_ns for p in read_only.rglob("*")}
    writable = tmp_path / "rw"
    node = await cluster.node(tmp_path, hub, dirs=ModelDirs(writable=(writable,), read_only=(read_only,)))
    assert await node.ensure(CARD, 0, 1) == read_only / "exo-test" / "sharded-llama"
    assert hub.requests == [] and not writable.exists()
    await eventually(lambda: (r := cluster.record(node)) is not None and r.status == "completed")
    assert cluster.record(node).source == "local"
    reply = await node.handle("delete", REPO)
    assert reply.ok and reply.message == f"deleted {REPO} from nowhere"
    assert {p: p.stat().st_mtime_ns for p in read_only.rglob("*")} == before
    await eventually(lambda: cluster.record(node) is None)


async def test_progress_is_reported_about_once_a_second_and_resumes_from_disk_after_a_restart(cluster, hub, model, tmp_path):
    hub.throttle_bps = 100_000  # ~5 s for the weights
    node = await cluster.node(tmp_path, hub, parallel_files=1)
    downloading = asyncio.ensure_future(node.ensure(CARD))
    await eventually(lambda: any(isinstance(e, DownloadProgressed) for e in cluster.published[node.node_id]), timeout=15)
    await node.stop()  # a restart: the process goes away mid-file
    with pytest.raises(DownloadCancelled):
        await downloading
    partials = tmp_path / "models" / "exo-test--sharded-llama" / PARTIAL_DIR
    on_disk = sum(p.stat().st_size for p in partials.rglob("*") if p.is_file())
    verified = sum((model / f).stat().st_size for f in SUPPORT) + sum(
        (model / f).stat().st_size for f in (FIRST, LAYER0, LAYER1)
        if (tmp_path / "models" / "exo-test--sharded-llama" / f).exists())
    assert on_disk > 0

    hub.throttle_bps = 400_000
    again = await cluster.node(tmp_path, hub, node_id=node.node_id, parallel_files=1)
    path = await again.ensure(CARD)
    progress = [e.progress for e in cluster.published[node.node_id] if isinstance(e, DownloadProgressed)]
    after_restart = progress[[p.status for p in progress].index("cancelled") + 1:]
    assert after_restart[0].done_bytes >= verified + on_disk  # not 0%: what was on disk counts
    assert after_restart[-1].status == "completed" and after_restart[-1].done_bytes == after_restart[-1].total_bytes
    assert all(b.updated_at - a.updated_at >= 0.95 for a, b in itertools.pairwise(after_restart[:-1]))
    assert all(p.speed_bps > 0 and p.eta_s is not None for p in after_restart[1:-1])
    resumed = [start for key, start in hub.ranges if start > 0]
    assert resumed and all(sha(path / f) == sha(model / f) for f in (FIRST, LAYER0, LAYER1))


async def test_cancel_and_delete_through_the_control_subject(cluster, hub, model, tmp_path):
    hub.throttle_bps = 100_000
    node = await cluster.node(tmp_path, hub)
    assert (await request_download_action(cluster.nc, node.node_id, "start", REPO)).ok
    await eventually(lambda: (r := cluster.record(node)) is not None and r.status == "downloading", timeout=15)
    cancelled = await request_download_action(cluster.nc, node.node_id, "cancel", REPO)
    assert cancelled.ok
    await eventually(lambda: cluster.record(node).status == "cancelled")
    nothing = await request_download_action(cluster.nc, node.node_id, "cancel", REPO)
    assert (nothing.ok, nothing.code) == (False, "not_found")
    hub.throttle_bps = None
    await node.ensure(CARD)
    deleted = await request_download_action(cluster.nc, node.node_id, "delete", REPO)
    assert deleted.ok and not (tmp_path / "models" / "exo-test--sharded-llama").exists()
    await eventually(lambda: cluster.record(node) is None)
    with pytest.raises(NodeUnreachable):
        await request_download_action(cluster.nc, uuid.uuid4().hex, "start", REPO)


async def test_a_second_node_fetches_from_the_first_through_nats_with_the_hub_stopped(cluster, hub, model, tmp_path):
    first = await cluster.node(tmp_path / "a", hub)
    await first.ensure(CARD)
    await eventually(lambda: (r := cluster.record(first)) is not None and r.status == "completed")
    hub.stop()
    second = await cluster.node(tmp_path / "b", None)
    path = await second.ensure(CARD)
    assert all(sha(path / f) == sha(model / f) for f in [*SUPPORT, FIRST, LAYER0, LAYER1])
    await eventually(lambda: (r := cluster.record(second)) is not None and r.status == "completed")
    assert cluster.record(second).source == f"peer:{first.node_id}"


async def test_a_peer_copy_that_fails_verification_is_fetched_from_the_hub(cluster, hub, model, tmp_path):
    first = await cluster.node(tmp_path / "a", hub)
    bad = await first.ensure(CARD) / LAYER0
    bad.write_bytes(bytes(bad.stat().st_size))  # same size, wrong bytes, behind the manifest's back
    await eventually(lambda: (r := cluster.record(first)) is not None and r.status == "completed")
    second = await cluster.node(tmp_path / "b", hub)
    path = await second.ensure(CARD)
    assert sha(path / LAYER0) == sha(model / LAYER0)
    assert hub.downloads[f"{REPO}/{LAYER0}"] == 2 and hub.downloads[f"{REPO}/{LAYER1}"] == 1
