"""Each node's own NATS identity: an nkey user seed kept in its data dir (readable by its owner
only), and the nats-server `authorization` users that admit such keys, each with the permissions
its node's roles give it (exo/core/node_roles.py). The server keeps only public keys: a client
proves it holds the seed by signing the server's nonce (nats-py's `nkeys_seed`).

A node loads its key at start to sign its token chunks (exo/bus/chunk_signing.py); the users block is
not wired into start-up yet (docs/deploy.md, "Per-node identities").
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import nkeys

from exo.bus.errors import BusError
from exo.core.node_roles import NatsPermissions, SubjectRules

SEED_FILE = "node.nk"
_PUBLIC_KEY = re.compile(r"U[A-Z2-7]{55}")  # base32 of prefix, 32-byte key and CRC-16


class NodeKeyError(BusError):
    """A node's key file cannot be used (too widely readable, not a user seed)."""


@dataclass(frozen=True)
class NodeKey:
    public_key: str  # "U...": what the servers' config names
    seed_file: Path  # what nats-py signs with (nats.connect(nkeys_seed=...))


def load_node_key(data_dir: Path) -> NodeKey:
    """The node's key, made on first use (mode 0600). A file others may read, or one that holds
    anything but a user seed, is refused: fix it or remove it (the node then gets a new key)."""
    path = data_dir / SEED_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        _write_private(path, nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))
    _check_private(path)
    return NodeKey(public_key=_public_key(path.read_bytes().strip(), path), seed_file=path)


def _check_private(path: Path) -> None:
    found = path.lstat()
    if not stat.S_ISREG(found.st_mode):
        raise NodeKeyError(f"{path} is not a regular file; a node's key must be a file of its own")
    mode = stat.S_IMODE(found.st_mode)
    if mode & 0o077:
        raise NodeKeyError(f"{path} has mode {mode:04o}: a node's key must be readable by its owner only; "
                           f"run chmod 600 {path}")
    if found.st_uid != os.geteuid():
        raise NodeKeyError(f"{path} belongs to user {found.st_uid}, not to this process's user {os.geteuid()}")


def _public_key(seed: bytes, path: Path) -> str:
    """The seed's public key; NodeKeyError (never showing the seed) unless it is a user seed."""
    try:
        prefix, raw = nkeys.decode_seed(seed)
        canonical = nkeys.encode_seed(raw, prefix) == seed  # decode_seed checks neither length nor checksum
    except (nkeys.NkeysError, ValueError, TypeError):
        prefix, canonical = None, False
    if not canonical:
        raise NodeKeyError(f"{path} does not hold an nkey seed; remove it to make a new key for this node")
    if prefix != nkeys.PREFIX_BYTE_USER:
        raise NodeKeyError(f"{path} holds an nkey seed of another kind (an account's, operator's or server's), "
                           "not a user's; remove it to make a new key for this node")
    return bytes(nkeys.from_seed(seed).public_key).decode()


def _write_private(path: Path, content: bytes) -> None:
    """Written readable by this user only from the start (O_EXCL), then moved into place."""
    partial = path.with_suffix(".tmp")
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(content + b"\n")
    partial.replace(path)


def check_public_key(key: str) -> str:
    """`key` if it is a user's public nkey (its prefix and checksum right), else a NodeKeyError."""
    decoded = b""
    if _PUBLIC_KEY.fullmatch(key):
        try:
            decoded = base64.b32decode(key)  # 56 characters: 35 bytes, no padding
        except binascii.Error:
            decoded = b""
    if len(decoded) != 35 or decoded[0] != nkeys.PREFIX_BYTE_USER or nkeys.crc16_checksum(decoded[:33]) != decoded[33:]:
        raise NodeKeyError(f"{key[:60]!r} is not a NATS user's public key (U followed by 55 base32 characters)")
    return key


def _rules(rules: SubjectRules) -> dict[str, list[str]]:
    return {"allow": list(rules.allow), **({"deny": list(rules.deny)} if rules.deny else {})}


def permissions_config(permissions: NatsPermissions) -> dict[str, object]:
    """nats-server's `permissions` map for one user."""
    config: dict[str, object] = {"publish": _rules(permissions.publish), "subscribe": _rules(permissions.subscribe)}
    if permissions.allow_responses:
        config["allow_responses"] = True  # each request it received may be answered once
    return config


def authorization_block(identities: Sequence[tuple[str, NatsPermissions]],
                        also: Sequence[Mapping[str, object]] = ()) -> str:
    """nats-server's `authorization` block admitting each (public key, permissions); `also`: users
    kept beside them (the shared `exo` and `operator` users while a cluster upgrades). JSON is
    valid nats-server config."""
    keys = [check_public_key(key) for key, _ in identities]
    if len(set(keys)) != len(keys):
        raise NodeKeyError("one public key is given twice: each node has a key of its own")
    users = [*also, *({"nkey": key, "permissions": permissions_config(p)} for key, (_, p) in zip(keys, identities, strict=True))]
    return "authorization: " + json.dumps({"users": users}, indent=2) + "\n"
