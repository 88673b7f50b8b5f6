"""A model's files at one commit, as nodes and peers exchange them (wire types: the model
store in exo/models and the peer transfer in exo/bus both speak them)."""

from __future__ import annotations

import msgspec


class FileMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a file must be. The Hub gives sha256 for LFS files and a git blob id for the rest;
    once a node has verified a file it also knows its sha256, which is what peers check."""

    size: int
    sha256: str = ""
    git_oid: str = ""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A model at one commit: every file the source offers, and which of them are verified on
    this disk (a node's copy of this is `.exo-manifest.json` in the model directory)."""

    repo_id: str
    revision: str = "main"
    commit: str = ""
    files: dict[str, FileMeta] = {}
    verified: list[str] = []


_manifest_decoder = msgspec.json.Decoder(Manifest)


def decode_manifest(data: bytes) -> Manifest:
    return _manifest_decoder.decode(data)


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)
