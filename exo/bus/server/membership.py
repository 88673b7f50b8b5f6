"""What a node of a discovered cluster chose (seed or join, its ports, the members last heard of),
kept in `cluster.json` beside its server's store so that a restart rejoins the same cluster at once
(exo/bus/server/cluster_node.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

MEMBERSHIP_FILE = "cluster.json"


class Membership(msgspec.Struct, kw_only=True):
    """What this node chose, kept across restarts."""

    cluster: str
    port: int  # its cluster port
    seeded: bool = False
    witness_port: int = 0
    witness_retired: bool = False
    routes: list[str] = []  # the members last heard of: where a restart dials


def load_membership(store_dir: Path) -> Membership | None:
    path = store_dir / MEMBERSHIP_FILE
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=Membership)


def save_membership(store_dir: Path, membership: Membership) -> None:
    partial = store_dir / (MEMBERSHIP_FILE + ".tmp")
    partial.write_bytes(msgspec.json.encode(membership))
    partial.replace(store_dir / MEMBERSHIP_FILE)
