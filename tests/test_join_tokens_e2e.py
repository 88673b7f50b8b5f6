"""A machine joins a cluster that has a secret with a join token (docs/deploy.md, "Joining with a
token"): `exo token create` on a member prints it; `exo join <token>` on the new machine gets the
cluster's secret and a member's address from that member's API, keeps the secret and becomes a
member; a restart needs the token no more; the spent token admits nobody else, with the reason."""

from __future__ import annotations

import subprocess
import uuid

import httpx
import pytest

from exo.bus.server.cluster_secret import SECRET_FILE
from exo.tools.cli import EXIT_ERROR
from tests.support.cluster import state_of, wait_until
from tests.support.exo_process import ExoProcess, exo_command
from tests.support.healing import stop_all
from tests.test_cluster_discovery import cluster_of

pytestmark = pytest.mark.slow


def exo_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=120)


def test_a_node_joins_with_a_token_once_and_the_spent_token_admits_no_one_else(tmp_path):
    namespace = f"token-{uuid.uuid4().hex[:8]}"
    env = {"EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": namespace, "EXO_JOIN_TIMEOUT_S": "20"}
    seed = ExoProcess(tmp_path / "seed", {**env, "EXO_DISCOVERY": "1", "EXO_CLUSTER_SECRET": "the-real-secret"}).start()
    nodes = [seed]
    try:
        made = exo_tool("token", "create", "--url", seed.url)
        assert made.returncode == 0, made.stderr
        token = made.stdout.splitlines()[0]
        assert token.startswith("exo-join-1.") and "the-real-secret" not in made.stdout
        assert "1 use(s) until" in made.stdout

        joined = ExoProcess(tmp_path / "joined", env, ["--no-discovery", "--join-token", token]).start(timeout=120)
        nodes.append(joined)
        assert cluster_of(joined) == cluster_of(seed)
        assert (joined.data_dir / "nats" / SECRET_FILE).read_text() == "the-real-secret"
        wait_until(lambda: len(state_of(seed).nodes) == 2, 30, 0.5, what="the joined node's worker registered")
        (kept,) = state_of(seed).join_tokens.values()
        assert kept.uses_left == 0 and len(kept.redeemed_by) == 1

        # A restart keeps the secret and needs the (spent) token no more.
        joined.interrupt()
        nodes.remove(joined)
        again = ExoProcess(tmp_path / "joined", env, ["--no-discovery", "--join-token", token]).start(timeout=120)
        nodes.append(again)
        assert cluster_of(again) == cluster_of(seed)

        # The spent token admits nobody else; the CLI says why and exits 1.
        late = exo_tool("join", token, "--data-dir", str(tmp_path / "late"), "--nats-port", "0", "--no-discovery",
                        "--api-port", "0")
        assert late.returncode == 1 and "this join token was used already" in late.stderr, late.stderr
        assert not (tmp_path / "late" / "nats" / SECRET_FILE).exists()

        listed = exo_tool("token", "list", "--url", seed.url)
        assert listed.returncode == 0 and kept.token_id in listed.stdout, listed.stdout
        forged = httpx.post(f"{seed.url}/cluster/join", json={"token": token[:-3] + "AAA"}, timeout=10)
        assert forged.status_code in (400, 403) and "cluster_secret" not in forged.text, forged.text
    finally:
        stop_all(nodes)


def test_a_trusted_lan_cluster_makes_no_tokens(tmp_path):
    env = {"EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": f"lan-{uuid.uuid4().hex[:8]}"}
    node = ExoProcess(tmp_path / "lan", {**env, "EXO_DISCOVERY": "1"}).start()
    try:
        refused = httpx.post(f"{node.url}/cluster/join_tokens", json={}, timeout=10)
        assert refused.status_code == 409 and "trusted-LAN cluster takes any node" in refused.text, refused.text
        made = exo_tool("token", "create", "--url", node.url)
        assert made.returncode == EXIT_ERROR and "not a member of a cluster with a secret" in made.stderr, made.stderr
    finally:
        stop_all([node])
