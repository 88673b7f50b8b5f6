"""An `--offline` node, as a user meets it: it says so in State, and placement sends a model it
does not have to the node that can download it, however many instances are placed (two `exo`
processes on one NATS, the local imitation of the Hub)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.exo_process import interrupt_all, start_all
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model
from tests.test_downloads_e2e import REPO, hub_env, node_id

pytestmark = pytest.mark.slow


def test_instances_of_a_model_the_offline_node_lacks_go_to_the_node_that_can_download_it(tmp_path):
    nats = NatsServer(tmp_path / "nats")
    hub = FakeHub({REPO: make_sharded_model(tmp_path / "repo")})
    hub.start()
    env = hub_env(hub, tmp_path)
    online, offline = start_all([node_process(tmp_path, "a", nats.url, env=env),
                                 node_process(tmp_path, "b", nats.url, "--offline", "--no-master", "--no-api", env=env)])
    try:
        a, b = node_id(online), (offline.data_dir / "node_id").read_text().strip()
        wait_until(lambda: {a, b} <= set(state_of(online).nodes), 30, what="both nodes in State")
        assert (state_of(online).nodes[a].offline, state_of(online).nodes[b].offline) == (False, True)
        with httpx.Client(base_url=online.url, timeout=60) as http:
            assert http.post("/models/add", json={"model_id": REPO}).status_code == 200
            for _ in range(2):  # the second would go to b, the less loaded node, if b could download
                placed = http.post("/place_instance", json={"model_id": REPO})
                assert placed.status_code == 200, placed.text
        instances = list(state_of(online).instances.values())
        assert len(instances) == 2 and {s.node_id for i in instances for s in i.shards} == {a}
    finally:
        interrupt_all([online, offline])
        hub.stop()
        nats.stop()
