"""A node on a small disk: its streams are made to fit the disk JetStream has (with a log line),
and a restart never fails on streams that exist. Its second start used to fail on a 12 GB
filesystem with "insufficient storage resources available": provisioning sent every stream to
CREATE again, and the server checks the storage reservation before it sees the stream exists.

Runs on a tmpfs mounted for the test (root only); skipped with the reason elsewhere, required in
CI (EXO_REQUIRE_MOUNT=1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.bus.connection import connect
from exo.bus.errors import BusError
from exo.bus.provision import provision, stream_configs
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.stream_fit import FITTED_TO_DISK, MIN_STREAM_BYTES
from tests.support.mounts import mounted_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "disk", "12g")  # the size the issue saw: room for less than the files ask


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "tiny", "100m")


async def _provision_once(store: Path) -> dict[str, dict]:
    server = EmbeddedNats(store, port=0)
    url = await server.start()
    try:
        nc = await connect([url], name="t")
        try:
            await provision(nc)
            js = nc.jetstream()
            return {c["name"]: (await js.stream_info(c["name"])).config.as_dict() for c in stream_configs()}
        finally:
            await nc.close()
    finally:
        server.stop()


async def test_streams_fit_a_small_disk_and_every_restart_provisions(small_disk: Path, caplog):
    first = await _provision_once(small_disk / "nats")
    wanted = {c["name"]: c.get("max_bytes", -1) for c in stream_configs()}
    fitted = {name: config["max_bytes"] for name, config in first.items() if config["max_bytes"] != wanted[name]}
    assert fitted, "12 GB leaves JetStream ~9 GB: not every stream's file limit fits"
    for name, size in fitted.items():
        assert MIN_STREAM_BYTES <= size < wanted[name]
        assert first[name]["metadata"][FITTED_TO_DISK] == str(wanted[name])
        assert f"stream {name} made with max_bytes" in caplog.text
    for _ in range(2):  # each restart: the existing streams are checked, never created again
        again = await _provision_once(small_disk / "nats")
        assert {name: c["max_bytes"] for name, c in again.items()} == {name: c["max_bytes"] for name, c in first.items()}


async def test_a_disk_with_no_room_is_refused_with_the_numbers(tiny_disk: Path):
    with pytest.raises(BusError, match=r"no room on its disk for this stream even at 0\.06 GiB \(streams/\S+\.json asks"):
        await _provision_once(tiny_disk / "nats")
