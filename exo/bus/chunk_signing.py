"""Token chunks signed with the publishing node's key (its nkey, exo/bus/server/node_keys.py), and
checked by the API node before they reach a client: the shared `exo` credential lets anyone
publish on exo.tokens.<id>, but only the node running a task's run holds that node's seed.

The signature covers the subject and the exact payload bytes, so a chunk cannot be moved to
another task's stream or changed on the way. It travels in NATS headers (kept by EXO_TOKENS).
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

SIGNER_HEADER = "Exo-Signer"  # the node id that signed
SIGNATURE_HEADER = "Exo-Signature"  # base64 of the ed25519 signature over signed_bytes()


def signed_bytes(subject: str, payload: bytes) -> bytes:
    # NUL cannot occur in a subject: subject and payload cannot be re-split into another pair.
    return subject.encode() + b"\0" + payload


class ChunkSigner:
    """Signs chunks as `node_id`. Built from the seed file's path: the seed itself never passes
    through argv, the environment or a log."""

    def __init__(self, node_id: str, seed: bytes) -> None:
        self.node_id = node_id
        self._keys = nkeys.from_seed(bytearray(seed))

    @classmethod
    def from_file(cls, node_id: str, seed_file: Path) -> ChunkSigner:
        return cls(node_id, seed_file.read_bytes().strip())

    @property
    def public_key(self) -> str:
        return bytes(self._keys.public_key).decode()

    def headers(self, subject: str, payload: bytes) -> dict[str, str]:
        signature = self._keys.sign(signed_bytes(subject, payload))
        return {SIGNER_HEADER: self.node_id, SIGNATURE_HEADER: base64.b64encode(signature).decode()}


@functools.lru_cache(maxsize=256)
def _verify_key(public_key: str) -> nacl.signing.VerifyKey | None:
    """The ed25519 key of a user's public nkey ("U..."), or None if it is not one."""
    try:
        raw = base64.b32decode(public_key)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER or nkeys.crc16_checksum(raw[:33]) != raw[33:]:
        return None
    return nacl.signing.VerifyKey(raw[1:33])


def signature_valid(public_key: str, subject: str, payload: bytes, signature: str) -> bool:
    key = _verify_key(public_key)
    if key is None:
        return False
    try:
        key.verify(signed_bytes(subject, payload), base64.b64decode(signature, validate=True))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
        return False
    return True


def message_check(subject: str, payload: bytes, headers: dict[str, str] | None) -> Callable[[str], bool]:
    """Whether this message was signed by a given public key: what the reducer asks of an event
    (exo/core/event_signers.py). An unsigned message answers False without any crypto."""
    signature = (headers or {}).get(SIGNATURE_HEADER, "")
    if not signature:
        return _unsigned
    return functools.partial(_signed_by, subject, payload, signature)


def _unsigned(public_key: str) -> bool:
    return False


def _signed_by(subject: str, payload: bytes, signature: str, public_key: str) -> bool:
    return signature_valid(public_key, subject, payload, signature)
