"""What `exo` prints once its node is ready: where the API and the dashboard are, what to do next,
and one line per real risk, each with its fix.

The first line keeps its old shape ("exo: node ready, API at ..., NATS at ...") for scripts that wait
for it.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from exo.bus.server.cluster_secret import SECRET_FILE
from exo.bus.server.embedded import CREDENTIALS_FILE
from exo.bus.server.jetstream_cluster import redundancy

if TYPE_CHECKING:
    from exo.node import Node

EXAMPLE_MODEL = "mlx-community/Qwen3-0.6B-4bit"  # a built-in card (cards/), small enough for any machine
EXAMPLE_HUB_MODEL = "mlx-community/SmolLM2-135M-Instruct"


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def banner(node: Node) -> str:
    nats = ",".join(node.shown_nats_urls)
    if node.embedded is not None:
        nats += f" (users exo and operator, passwords in {node.embedded.store_dir / CREDENTIALS_FILE})"
    lines = [f"exo: node ready, API at {node.api_url or '(off)'}, NATS at {nats}"]
    lines += [f"  {note}" for note in node.notes]
    cluster = node.cluster
    if cluster is not None and cluster.membership is not None and cluster.join_address:
        lines.append(f"  cluster {cluster.membership.cluster}: another node joins it as a member with "
                     f"--join {cluster.join_address} (or by discovery on this LAN)")
    if node.api_url:
        lines.append(f"  node {node.name!r}; dashboard: {node.api_url}/")
        lines += next_steps(node.api_url.removeprefix("http://"), node.api_keys_required)
    lines += [f"  risk: {risk}" for risk in risks(node)]
    return "\n".join(lines)


def next_steps(where: str, keys: bool) -> list[str]:
    """The commands that take a new user from a started node to a chat answer."""
    curl = "curl -H 'Authorization: Bearer <key>'" if keys else "curl"
    return [
        "  next: run a model on the cluster (it downloads first), then chat with it:",
        f"""    {curl} -X POST {where}/place_instance -d '{{"model_id": "{EXAMPLE_MODEL}", "wait": true}}'""",
        f"""    {curl} {where}/v1/chat/completions -d '{{"model": "{EXAMPLE_MODEL}", """
        """"messages": [{"role": "user", "content": "Hello"}]}'""",
        f"  more models: {curl} {where}/v1/models lists them; add one from the Hub (a local dir: add \"path\": \"/abs/dir\"):",
        f"""    {curl} -X POST {where}/models/add -d '{{"model_id": "{EXAMPLE_HUB_MODEL}"}}'""",
    ]


def risks(node: Node) -> list[str]:
    """What this node's settings leave open, each with the setting that closes it."""
    config = node.config
    found = []
    if node.api_url and not node.api_keys_required and not is_loopback(config.api_host):
        found.append(f"the API listens on {config.api_host}:{config.api_port} without API keys: anyone who can "
                     f"reach this machine can use it; fix: --host 127.0.0.1 (this machine only) or "
                     f"EXO_API_KEYS=<key> (or --api-key)")
    discovery = config.discovery
    if discovery is not None and config.trusted_lan and not is_loopback(discovery.address):
        found.append(f"trusted-LAN mode: any exo of namespace {discovery.namespace!r} on the LAN can join this "
                     f"node's NATS cluster and read or write its log; fix: start every node once with the same "
                     f"EXO_CLUSTER_SECRET=<long random string, e.g. from `openssl rand -hex 24`> "
                     f"(kept in {config.data_dir / 'nats' / SECRET_FILE})")
    if config.nats_urls and node.event_log_replicas == 1:
        found.append(f"no redundancy: {redundancy(1).removeprefix('none: ')}")
    return found
