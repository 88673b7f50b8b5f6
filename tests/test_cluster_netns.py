"""Zero-config clusters over a real (virtual) LAN (issue #21): three network namespaces joined by
a bridge, each running `exo` with no discovery flags at all, on its default interface and
route, as on three machines. Needs root (network namespaces): skipped otherwise with the
reason, and CI (root) runs it (EXO_REQUIRE_NETNS=1 turns the skip into a failure)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import pytest

from exo.bus.provision import stream_configs
from tests.support.cluster import state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, exo_command
from tests.support.healing import stop_all
from tests.support.tiny_model import make_tiny_model
from tests.test_cluster_discovery import MESSAGES, chat, cluster_of, start_together

pytestmark = pytest.mark.slow

SUBNET = "10.77.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def require_netns() -> None:
    reason = ""
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    else:
        probe = f"exo-probe-{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            reason = f"`ip netns add` failed: {made.stderr.strip()}"
        else:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if reason and os.environ.get("EXO_REQUIRE_NETNS") == "1":
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)


@pytest.fixture
def lan() -> Iterator[list[tuple[str, str]]]:
    """Three namespaces on one bridge, each with an address and a default route: a small LAN."""
    require_netns()
    tag = uuid.uuid4().hex[:5]
    bridge, third = f"exobr{tag}", str(100 + os.getpid() % 150)
    namespaces = [f"exo{tag}{n}" for n in range(3)]
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("addr", "add", SUBNET.format(third, 254) + "/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for n, ns in enumerate(namespaces):
            outside, inside = f"v{tag}{n}", f"e{tag}{n}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", bridge, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("-n", ns, "addr", "add", SUBNET.format(third, n + 1) + "/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", SUBNET.format(third, 254))
        yield [(ns, SUBNET.format(third, n + 1)) for n, ns in enumerate(namespaces)]
    finally:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def node_in(namespace: str, address: str, data_dir, env: dict[str, str]) -> ExoProcess:
    node = ExoProcess(data_dir, env)
    node.args = ["ip", "netns", "exec", namespace, *exo_command(), "--data-dir", str(data_dir), "--host", "0.0.0.0"]
    node.url = f"http://{address}:52415"
    return node


def test_three_machines_on_a_bridge_form_one_cluster_with_no_flags(tmp_path, lan):
    model_dir = make_tiny_model(tmp_path / "model")
    expected = Reference(model_dir).chat(MESSAGES, max_tokens=12)
    env = {"EXO_DISCOVERY": "1", "EXO_NAMESPACE": "default"}  # what a machine without any EXO_* variable has
    nodes = [node_in(ns, address, tmp_path / f"machine-{n}", env) for n, (ns, address) in enumerate(lan)]
    try:
        start_together(nodes)
        assert len({cluster_of(node) for node in nodes}) == 1

        def replicated() -> bool:
            layout = state_of(nodes[0]).cluster
            return (len([s for s in layout.servers if s.online]) == 3 and len(layout.streams) == len(stream_configs())
                    and all(s.replicas == 3 and len(s.followers) == 2 for s in layout.streams))

        wait_until(replicated, 90, 1.0, "every stream on three machines")
        # each found its own LAN address (not loopback) and the others dial it there
        wait_until(lambda: all(f"nats-route://{address}:" in "".join(_membership(other) for other in nodes if other is not node)
                               for node, (_, address) in zip(nodes, lan)), 30, 0.5, "routes to every LAN address")
        assert "127.0.0.1" not in "".join(_membership(node) for node in nodes)
        added = httpx.post(f"{nodes[0].url}/models/add", json={"model_id": "local/tiny", "path": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        placed = httpx.post(f"{nodes[2].url}/place_instance", json={"model_id": "local/tiny"}, timeout=120)
        assert placed.status_code == 200, placed.text
        assert [chat(node) for node in nodes] == [expected] * 3
    finally:
        stop_all(nodes)


def _membership(node: ExoProcess) -> str:
    return (node.data_dir / "nats" / "cluster.json").read_text()
