"""The secret a discovered cluster's routes carry, and where a node's LAN address is.

A secret given once (`--cluster-secret` / EXO_CLUSTER_SECRET) is kept in the node's store, so
restarts need no flag. Without one the node runs in trusted-LAN mode: the routes' password is
derived from the namespace, which anyone on the LAN who runs exo can do. That is how exo itself
and the API without keys behave, so it is the default, but the start banner names it as a risk with
its fix (exo/banner.py).
Nodes announce a digest of their secret and pair only with nodes that have the same one.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

SECRET_FILE = "cluster-secret"


class ClusterSecret:
    def __init__(self, value: str, trusted_lan: bool) -> None:
        self.value = value
        self.trusted_lan = trusted_lan

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"exo-cluster-secret:{self.value}".encode()).hexdigest()[:16]


def resolve_secret(store_dir: Path, given: str, namespace: str) -> ClusterSecret:
    path = store_dir / SECRET_FILE
    if given:
        store_dir.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(given)
        return ClusterSecret(given, trusted_lan=False)
    if path.exists():
        return ClusterSecret(path.read_text().strip(), trusted_lan=False)
    derived = hashlib.sha256(f"exo-trusted-lan:{namespace}".encode()).hexdigest()
    return ClusterSecret(derived, trusted_lan=True)


def lan_address() -> str:
    """This machine's address on its default route (no packet is sent); 127.0.0.1 without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
            address: str = probe.getsockname()[0]  # (host, port) for AF_INET
            return address
        except OSError:
            return "127.0.0.1"
