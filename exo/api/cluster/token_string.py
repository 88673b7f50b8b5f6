"""A join token as a string (exo/core/join_tokens.py has the rest): `exo-join-1.` and base64url of
`{"api": <a member's API URL>, "id": <token id>, "secret": <its secret>}`. Made by the API
(exo/api/cluster/join_tokens.py), read by the API and by a joining node (exo/join_token.py)."""

from __future__ import annotations

import base64
import binascii
import re

import msgspec

from exo.core.join_tokens import TOKEN_ID

PREFIX = "exo-join-1."
_SECRET = re.compile(r"[A-Za-z0-9_-]{32,128}")


class TokenParts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a token string holds."""

    api: str  # a member's API, where the new node redeems it
    id: str
    secret: str


class BadToken(ValueError):
    """Not a join token (its text says why, never the secret)."""


def encode_token(parts: TokenParts) -> str:
    return PREFIX + base64.urlsafe_b64encode(msgspec.json.encode(parts)).decode().rstrip("=")


def decode_token(token: str) -> TokenParts:
    token = token.strip()
    if not token.startswith(PREFIX):
        raise BadToken(f"a join token starts with {PREFIX!r} (`exo token create` prints one)")
    body = token.removeprefix(PREFIX)
    try:
        parts = msgspec.json.decode(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), type=TokenParts)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise BadToken("the join token is damaged (copy it whole, as `exo token create` printed it)") from None
    if not TOKEN_ID.fullmatch(parts.id) or not _SECRET.fullmatch(parts.secret):
        raise BadToken("the join token is damaged (its id or secret is malformed)")
    if not parts.api.startswith(("http://", "https://")):
        raise BadToken(f"the join token names no member API ({parts.api[:60]!r})")
    return parts
