"""Join tokens (pure): how a new machine joins a cluster that has a secret, as k3s, Docker swarm and
Tailscale let one: `exo token create` on an admin node, `exo join <token>` on the new one.

A token names a member's API, its id and its secret (the string: exo/join_token.py). State keeps
only the secret's sha256 (readers of the log never see a usable token), its expiry and how many
uses it has left. The new node posts the token to that
API (`POST /cluster/join`, no API key: the token is the credential); the API checks it against
State, the master decides the use (one at a time: two nodes racing for a single-use token get one
each only if it had two uses), and the API answers with the cluster's secret and a member's
cluster address, which the new node keeps and joins with (exo/join_token.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from exo.core.skip import Skip

if TYPE_CHECKING:  # State holds JoinToken: the draft of a State cannot be imported here at run time
    from exo.core.draft import Draft

MAX_TOKENS = 1000  # kept in State, newest last: created tokens beyond it drop the oldest
MAX_TTL_S = 30 * 86400.0
MIN_TTL_S = 60.0
MAX_USES = 100
MAX_REDEEMERS = 100  # names kept per token, for `exo token list` and the log
TOKEN_ID = re.compile(r"[0-9a-f]{16}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class JoinToken(msgspec.Struct, frozen=True, kw_only=True):
    token_id: str
    secret_sha256: str  # of its secret: never the secret
    expires_at: float  # wall clock
    uses_left: int
    created_at: float = 0.0
    created_by: str = ""  # the API key (or an admin) and the API node that made it
    redeemed_by: list[str] = []  # the names the nodes that used it gave, oldest first


def secret_digest(secret: str) -> str:
    return hashlib.sha256(f"exo-join-token:{secret}".encode()).hexdigest()


def create_problem(token_id: str, secret_sha256: str, ttl_s: float, uses: int,
                   tokens: Mapping[str, JoinToken]) -> str | None:
    """Why a token cannot be made (None: it can)."""
    if not TOKEN_ID.fullmatch(token_id) or not _SHA256.fullmatch(secret_sha256):
        return "a join token's id is 16 hex digits and its digest a sha256"
    if token_id in tokens:
        return f"join token {token_id} exists already"
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        return f"ttl must be between {MIN_TTL_S:g} s and {MAX_TTL_S / 86400:g} days, not {ttl_s:g} s"
    if not 1 <= uses <= MAX_USES:
        return f"uses must be between 1 and {MAX_USES}, not {uses}"
    return None


def redeem_problem(tokens: Mapping[str, JoinToken], token_id: str, secret_sha256: str, now: float) -> str | None:
    """Why a token cannot be used now (None: it can). An unknown id and a wrong secret read alike."""
    token = tokens.get(token_id)
    if token is None or not _digests_equal(token.secret_sha256, secret_sha256):
        return "this join token is not valid here (unknown to this cluster, or its secret is wrong)"
    if now >= token.expires_at:
        return "this join token has expired: make another with `exo token create`"
    if token.uses_left <= 0:
        return "this join token was used already: make another with `exo token create`"
    return None


def _digests_equal(a: str, b: str) -> bool:
    return hashlib.sha256(a.encode()).digest() == hashlib.sha256(b.encode()).digest()  # no early exit on a's bytes


def on_token_created(draft: Draft, token: JoinToken) -> None:
    if (problem := create_problem(token.token_id, token.secret_sha256, token.expires_at - token.created_at,
                                  token.uses_left, draft.join_tokens)) is not None:
        raise Skip(problem)
    tokens = draft.own("join_tokens")
    for token_id in [t for t, kept in tokens.items() if kept.expires_at <= token.created_at]:
        del tokens[token_id]  # expired: of no use to anyone
    tokens[token.token_id] = token
    while len(tokens) > MAX_TOKENS:
        del tokens[next(iter(tokens))]


def on_token_redeemed(draft: Draft, token_id: str, secret_sha256: str, node_name: str, at: float) -> None:
    if (problem := redeem_problem(draft.join_tokens, token_id, secret_sha256, at)) is not None:
        raise Skip(problem)
    tokens = draft.own("join_tokens")
    token = tokens[token_id]
    tokens[token_id] = msgspec.structs.replace(token, uses_left=token.uses_left - 1,
                                               redeemed_by=[*token.redeemed_by, node_name[:100]][-MAX_REDEEMERS:])


def describe(token: JoinToken) -> dict[str, object]:
    """A token as `exo token list` shows it: never its digest."""
    return {"token_id": token.token_id, "expires_at": token.expires_at, "uses_left": token.uses_left,
            "created_by": token.created_by, "redeemed_by": list(token.redeemed_by)}
