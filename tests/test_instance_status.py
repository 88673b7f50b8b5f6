"""What the API says about a placed instance: each runner's status and download, the instance's
status and error (GET /instance/{id}), and POST /place_instance with `wait`, which answers once the
instance is ready or failed: a repository missing from the Hub is a 424 with the download's code.

The report itself is pure (`report_of`): tested on hand-made States. The routes run against `exo`
as a process and the local imitation of the Hub.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest

from exo.api.cluster.instances import report_of
from exo.bus.subjects import download_control_subject, model_share_subject
from exo.core.state import State
from exo.core.types import DownloadProgress, Instance, RunnerInfo, ShardAssignment
from tests.support.cluster import wait_until
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model

MODEL = "org/model"
REASON = "repository not found on the Hub: org/model (a private one needs HF_TOKEN)"


def two_ranks(a: RunnerInfo | None, b: RunnerInfo | None, downloads: dict | None = None) -> tuple[State, Instance]:
    instance = Instance(instance_id="i1", model_id=MODEL, shards=[
        ShardAssignment(runner_id="r1", node_id="b", rank=1, world_size=2, start_layer=1, end_layer=2),
        ShardAssignment(runner_id="r0", node_id="a", rank=0, world_size=2, start_layer=0, end_layer=1),
    ])
    runners = {r.runner_id: r for r in (a, b) if r is not None}
    return State(instances={"i1": instance}, runners=runners, downloads=downloads or {}), instance


def runner(runner_id: str, node_id: str, status: str = "created", error: str = "") -> RunnerInfo:
    return RunnerInfo(runner_id=runner_id, instance_id="i1", node_id=node_id, status=status, error=error)  # type: ignore[arg-type]


def test_a_runner_failed_by_its_download_fails_the_instance_with_the_download_code():
    failed = DownloadProgress(node_id="b", model_id=MODEL, status="failed", error_code="not_found", error=REASON)
    state, instance = two_ranks(runner("r0", "a", "ready"), runner("r1", "b", "failed", f"download failed: {REASON}"),
                                {"b": {MODEL: failed}})
    report = report_of(state, instance)
    assert msgspec.to_builtins(report) == {
        "status": "failed", "error": f"download failed: {REASON}", "error_code": "not_found",
        "runners": [
            {"runner_id": "r0", "node_id": "a", "rank": 0, "status": "ready", "error": "", "download": None,
             "failures": 0},
            {"runner_id": "r1", "node_id": "b", "rank": 1, "status": "failed", "error": f"download failed: {REASON}",
             "download": {"status": "failed", "done_bytes": 0, "total_bytes": 0, "speed_bps": 0.0, "eta_s": None,
                          "source": "", "error_code": "not_found", "error": REASON}, "failures": 0},
        ],
    }
    assert report.failed_runner is not None and report.failed_runner.node_id == "b"


def test_a_runner_that_failed_otherwise_is_runner_failed_even_beside_an_old_failed_download():
    old = DownloadProgress(node_id="a", model_id=MODEL, status="failed", error_code="network", error="reset")
    state, instance = two_ranks(runner("r0", "a", "failed", "runner exited with code 1"), runner("r1", "b", "loading"),
                                {"a": {MODEL: old}})
    report = report_of(state, instance)
    assert (report.status, report.error, report.error_code) == ("failed", "runner exited with code 1", "runner_failed")


def test_an_instance_is_as_far_as_its_least_advanced_runner():
    def status(a: str | None, b: str | None) -> tuple[str, str, str]:
        state, instance = two_ranks(a and runner("r0", "a", a), b and runner("r1", "b", b))
        report = report_of(state, instance)
        return report.status, report.error, report.error_code

    assert status("ready", "ready") == ("ready", "", "")
    assert status("ready", "warming_up") == ("warming_up", "", "")
    assert status("loading", "downloading") == ("downloading", "", "")
    assert status("ready", None) == ("created", "", "")  # its runner is not in State yet
    assert status("stopped", "ready") == ("stopped", "", "")
    assert status("stopped", "failed") == ("failed", "the runner failed", "runner_failed")


def test_a_download_in_progress_shows_on_its_runner():
    going = DownloadProgress(node_id="a", model_id=MODEL, status="downloading", done_bytes=10, total_bytes=40,
                             speed_bps=5.0, eta_s=6.0, source="peer:b", updated_at=99.0)
    state, instance = two_ranks(runner("r0", "a", "downloading"), runner("r1", "b", "ready"), {"a": {MODEL: going}})
    report = report_of(state, instance)
    assert report.status == "downloading"
    assert msgspec.to_builtins(report.runners[0].download) == {
        "status": "downloading", "done_bytes": 10, "total_bytes": 40, "speed_bps": 5.0, "eta_s": 6.0,
        "source": "peer:b", "error_code": "", "error": ""}


def test_the_share_and_control_subjects_come_from_the_subjects_table():
    assert model_share_subject("n1", "manifest") == "exo.models.n1.manifest"
    assert model_share_subject("n1", "chunk") == "exo.models.n1.chunk"
    assert [download_control_subject("n1", a) for a in ("start", "cancel", "delete")] == [
        "exo.downloads.n1.start", "exo.downloads.n1.cancel", "exo.downloads.n1.delete"]


# --- the routes, against `exo` as a process -------------------------------------------------

GOOD = "exo-test/sharded-llama"
GONE = "exo-test/gone"
GONE_REASON = f"repository not found on the Hub: {GONE} (a private one needs HF_TOKEN)"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    model = make_sharded_model(tmp_path_factory.mktemp("hub") / "sharded-llama")
    with FakeHub({GOOD: model, GONE: model}) as fake:
        yield fake


@pytest.fixture(scope="module")
def gone(http, hub) -> str:
    """A model whose card was added, then whose repository disappeared from the Hub."""
    assert http.post("/models/add", json={"model_id": GONE}).status_code == 200
    del hub.repos[GONE]
    return GONE


def error(message: str, param: str | None = "wait", kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@pytest.mark.slow
def test_wait_values_that_make_no_sense_are_400s_before_anything_is_placed(http, gone):
    def place(params: dict | None = None, **body) -> httpx.Response:
        return http.post("/place_instance", params=params, json={"model_id": gone, **body})

    bad = place(wait="soon")
    assert (bad.status_code, bad.json()) == (400, error(
        "invalid request body: Expected `bool | float | null`, got `str` - at `$.wait`"))
    for value, shown in (("-1", "-1"), ("3601", "3601"), ("nan", "nan")):
        bad = place({"wait": value})
        assert (bad.status_code, bad.json()) == (400, error(f"wait must be between 0 and 3600 seconds, got {shown}"))
    bad = place(wait=1e9)
    assert (bad.status_code, bad.json()) == (400, error("wait must be between 0 and 3600 seconds, got 1e+09"))
    bad = place({"wait": "later"})
    assert (bad.status_code, bad.json()) == (400, error(
        "wait must be true, false or a number of seconds, got 'later'"))
    assert http.get("/state").json()["instances"] == {}


@pytest.mark.slow
def test_a_missing_repository_is_reported_on_the_instance_and_by_place_with_wait(http, gone):
    node_id = http.get("/node_id").json()
    # Without `wait`: the same answer as always, at once.
    placed = http.post("/place_instance", json={"model_id": gone})
    assert placed.status_code == 200, placed.text
    body = placed.json()
    assert sorted(body) == ["command_id", "evicted", "instance", "instance_id", "message"]
    assert body["message"] == "instance placed" and body["evicted"] == []  # nothing had to make room
    instance_id = body["instance_id"]
    (shard,) = body["instance"]["shards"]

    seen = wait_until(lambda: (r := http.get(f"/instance/{instance_id}").json())["status"] == "failed" and r, 60,
                      what="the instance fails")
    assert seen["created_seq"] > 0  # the place answer has the event's instance, before State numbered it
    assert seen == {
        **body["instance"], "created_seq": seen["created_seq"],
        "status": "failed", "error": f"download failed: {GONE_REASON}", "error_code": "not_found",
        "runners": [{"runner_id": shard["runner_id"], "node_id": node_id, "rank": 0, "status": "failed",
                     "error": f"download failed: {GONE_REASON}",
                     "download": {"status": "failed", "done_bytes": 0, "total_bytes": 0, "speed_bps": 0.0,
                                  "eta_s": None, "source": "", "error_code": "not_found", "error": GONE_REASON},
                     "failures": 1}],  # not restarted: the repository will not come back by waiting
    }

    # With `wait` (in the body or the query): the failure is the answer, a 424 with the download's code.
    for answer in (http.post("/place_instance", json={"model_id": gone, "wait": True}),
                   http.post("/place_instance", params={"wait": "60"}, json={"model_id": gone})):
        assert answer.status_code == 424, answer.text
        failed_id = answer.json()["error"]["instance_id"]
        assert failed_id != instance_id
        assert answer.json() == {"error": {
            "message": f"instance {failed_id} failed on node {node_id}: download failed: {GONE_REASON}",
            "type": "download_error", "param": "model_id", "code": "not_found",
            "instance_id": failed_id, "node_id": node_id}}
        assert http.get(f"/instance/{failed_id}").json()["status"] == "failed"
    missing = http.get("/instance/nothing-here")
    assert (missing.status_code, missing.json()) == (404, error("unknown instance 'nothing-here'", None, "not_found_error"))


@pytest.mark.slow
def test_place_with_wait_answers_202_while_on_its_way_and_200_once_ready(http, hub):
    assert http.post("/models/add", json={"model_id": GOOD}).status_code == 200
    node_id = http.get("/node_id").json()
    early = http.post("/place_instance", params={"wait": "0.001"}, json={"model_id": GOOD})
    assert early.status_code == 202, early.text
    body = early.json()
    instance_id = body["instance_id"]
    (shard,) = body["instance"]["shards"]
    # On its way, not ready: usually not even started (a worker spawns a process first), but on a
    # busy machine the worker may already be downloading by the time the API reads State.
    on_its_way = ("created", "downloading", "downloaded", "loading", "warming_up")
    (runner,) = body["runners"]
    assert body["status"] in on_its_way and runner.pop("status") in on_its_way, body
    assert runner.pop("download") is None or body["status"] != "created", body
    assert body == {
        "message": "instance placed; not ready after 0.001 s", "command_id": body["command_id"],
        "instance_id": instance_id, "instance": body["instance"], "status": body["status"], "error": "",
        "error_code": "", "runners": [{"runner_id": shard["runner_id"], "node_id": node_id, "rank": 0, "error": "",
                                       "failures": 0}], "evicted": [],
    }

    ready = wait_until(lambda: (r := http.get(f"/instance/{instance_id}").json())["status"] == "ready" and r, 120,
                       what="the instance is ready")
    (runner,) = ready["runners"]
    download = runner.pop("download")
    assert runner == {"runner_id": shard["runner_id"], "node_id": node_id, "rank": 0, "status": "ready", "error": "",
                      "failures": 0}
    assert (download["status"], download["source"], download["error_code"], download["error"]) == (
        "completed", "hub", "", "")
    assert download["done_bytes"] == download["total_bytes"] > 0
    assert (ready["status"], ready["error"], ready["error_code"]) == ("ready", "", "")

    second = http.post("/place_instance", json={"model_id": GOOD, "wait": 120})
    assert second.status_code == 200, second.text
    answer = second.json()
    assert (answer["message"], answer["status"], answer["error"], answer["error_code"]) == (
        "instance ready", "ready", "", "")
    assert [r["status"] for r in answer["runners"]] == ["ready"]
    for placed in (instance_id, answer["instance_id"]):
        assert http.delete(f"/instance/{placed}").status_code == 200
