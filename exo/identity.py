"""Who this node is: a node id kept in its data dir, stable across restarts and never cloned.

The id file also records where it was made (machine and data dir path). A data dir copied to
another machine or path therefore gets a fresh id, with a warning, instead of silently running
two nodes under one id; a lock on the data dir stops two processes sharing one dir.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import socket
import uuid
from pathlib import Path
from typing import IO

from exo.core.ids import NodeId

log = logging.getLogger(__name__)


class IdentityError(Exception):
    """The data dir cannot give this process a node id (already in use by another process)."""


def fingerprint(data_dir: Path) -> str:
    """The machine (its machine-id, else its host name) and the data dir's real path."""
    machine = ""
    for candidate in (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id")):
        try:
            machine = candidate.read_text().strip()
            break
        except OSError:
            continue
    machine = machine or platform.node() or socket.gethostname()
    return hashlib.sha256(f"{machine}\n{data_dir.resolve()}".encode()).hexdigest()[:32]


def lock_data_dir(data_dir: Path) -> IO[bytes]:
    """Hold an exclusive lock on the data dir for the life of the process (the file object keeps it)."""
    handle = open(data_dir / "node.lock", "wb")  # noqa: SIM115  # held for the process
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise IdentityError(f"another exo process is using the data dir {data_dir}") from None
    return handle


def load_node_id(data_dir: Path, new_id: str | None = None) -> NodeId:
    """This node's id: the one in data_dir/node_id if it was made here, else a fresh one (saved).

    data_dir/node_id holds just the id (operators and scripts read it); node_id.origin holds
    the fingerprint of where it was made.
    """
    id_path, origin_path = data_dir / "node_id", data_dir / "node_id.origin"
    here = fingerprint(data_dir)
    saved = _read(id_path)
    origin = _read(origin_path)
    if saved and origin in (None, here):
        if origin is None:  # written by an older exo: adopt it for this machine and path
            _write(origin_path, here)
        return NodeId(saved)
    node_id = NodeId(new_id or uuid.uuid4().hex)
    if saved:
        log.warning(
            "the data dir %s holds node id %s made on another machine or path (a copy?): this node takes "
            "the new id %s so that two nodes never share one", data_dir, saved, node_id,
        )
    _write(id_path, node_id)
    _write(origin_path, here)
    return node_id


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _write(path: Path, text: str) -> None:
    temporary = path.parent / f".{path.name}.tmp"
    temporary.write_text(text + "\n")
    os.replace(temporary, path)
