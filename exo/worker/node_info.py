"""What this node tells placement about itself: its name, memory, CPUs, MLX backend, addresses, ring ports,
whether it may fetch models."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

from exo.core.ids import InstanceId, NodeId
from exo.core.types import NodeInfo, PromptCacheStats
from exo.memory import memory

DEFAULT_RING_PORTS = (52600, 100)  # first port, how many: MLX ring groups of multi-node instances


@dataclass(frozen=True)
class NodeIdentity:
    """Who this node says it is, settled once at start (main.py's flags) and said at every beat."""

    name: str = ""  # "" : the hostname
    address: str = ""  # the address this node uses for peers (--discovery-address); "": the default route's
    advertised: tuple[str, ...] = ()  # EXO_ADVERTISE_ADDRESSES: the ring addresses peers dial; (): `address`
    ring_ports: str = ""  # EXO_RING_PORTS, "FIRST-LAST"; "": DEFAULT_RING_PORTS
    offline: bool = False  # --offline: it fetches no model, so placement prefers nodes that can
    public_key: str = ""  # its node key's public half (<data dir>/node.nk): the API checks its chunks' signatures


def describe_this_node(node_id: NodeId, incarnation: str, now: float,
                       prompt_caches: dict[InstanceId, PromptCacheStats] | None = None,
                       identity: NodeIdentity = NodeIdentity()) -> NodeInfo:
    total, available = memory()
    first, count = ring_ports(identity.ring_ports)
    return NodeInfo(
        node_id=node_id, hostname=platform.node(), name=identity.name or platform.node(),
        memory_total=total, memory_available=available, cpu_count=os.cpu_count() or 1, backend=mlx_backend(),
        last_seen=now, addresses=addresses(identity.address, identity.advertised),
        ring_port_first=first, ring_port_count=count, incarnation=incarnation, prompt_caches=prompt_caches or {},
        offline=identity.offline, public_key=identity.public_key,
    )


def mlx_backend() -> str:
    if platform.system() == "Darwin":
        return "metal"
    try:
        import mlx.core as mx  # only to ask which device it has; cheap once imported

        return "cuda" if mx.default_device() == mx.gpu else "cpu"
    except Exception:
        return "cpu"


def addresses(preferred: str = "", advertised: tuple[str, ...] = ()) -> list[str]:
    """`advertised` (EXO_ADVERTISE_ADDRESSES) if any, else `preferred` (the address discovery and the
    cluster routes use: one setting for the node), else the IPv4 of the default route, else loopback."""
    if advertised:
        return list(advertised)
    if preferred and preferred not in ("0.0.0.0", "::"):  # a wildcard is where to listen, not where to dial
        return [preferred]
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.254.254.254", 1))  # no packet is sent: this only picks the route
            found.append(probe.getsockname()[0])
        except OSError:
            pass
    return [a for a in found if not a.startswith("0.")] or ["127.0.0.1"]


def ring_ports(text: str) -> tuple[int, int]:
    """EXO_RING_PORTS as "first-last" (inclusive) -> (first, count); "": DEFAULT_RING_PORTS."""
    if not text:
        return DEFAULT_RING_PORTS
    first, _, last = text.partition("-")
    start, end = int(first), int(last or first)
    if not 0 < start <= end < 65536:
        raise ValueError(f"EXO_RING_PORTS={text!r}: expected FIRST-LAST with 0 < FIRST <= LAST < 65536")
    return start, end - start + 1
