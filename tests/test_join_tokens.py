"""Join tokens, decided and folded (exo/core/join_tokens.py, exo/master/join_tokens.py): the token
string, what State keeps (never a usable secret), each use decided once, and every refusal's reason.
The whole path (`exo token create`, `exo join`) is tests/test_join_tokens_e2e.py."""

import pytest

from exo.api.cluster.token_string import PREFIX, BadToken, TokenParts, decode_token, encode_token
from exo.core.apply import apply
from exo.core.commands import CreateJoinToken, RedeemJoinToken
from exo.core.events import CommandRejected, JoinTokenCreated, JoinTokenRedeemed
from exo.core.join_tokens import JoinToken, describe, secret_digest
from exo.core.state import State
from tests.support.as_master import stamped
from tests.test_decide import run, with_node

SECRET = "s" * 43
TOKEN_ID = "0123456789abcdef"
NOW = 1_800_000_000.0


def made(state: State | None = None, *, uses: int = 1, ttl_s: float = 3600.0, token_id: str = TOKEN_ID,
         at: float = NOW) -> tuple[State, list]:
    return run(state or with_node(), CreateJoinToken(command_id=f"make-{token_id}-{at}", token_id=token_id,
                                                     secret_sha256=secret_digest(SECRET), ttl_s=ttl_s, uses=uses,
                                                     created_by="an admin", at=at))


def use(state: State, command_id: str, *, secret: str = SECRET, at: float = NOW + 10,
        token_id: str = TOKEN_ID) -> tuple[State, list]:
    return run(state, RedeemJoinToken(command_id=command_id, token_id=token_id, secret_sha256=secret_digest(secret),
                                      node_name=command_id, at=at))


def refusal(events: list) -> tuple[str, str]:
    (rejected,) = events
    assert isinstance(rejected, CommandRejected), rejected
    return rejected.code, rejected.reason


def test_a_token_string_carries_the_api_its_id_and_secret_and_nothing_else_passes():
    parts = TokenParts(api="http://192.168.1.5:52415", id=TOKEN_ID, secret=SECRET)
    token = encode_token(parts)
    assert token.startswith(PREFIX) and decode_token(f"  {token}\n") == parts
    for bad, why in [("exo-join-2.abc", "starts with 'exo-join-1.'"), (PREFIX + "!!!", "damaged"),
                     (token[:-5], "damaged"),
                     (encode_token(TokenParts(api="http://x", id="xyz", secret=SECRET)), "id or secret is malformed"),
                     (encode_token(TokenParts(api="file:///etc", id=TOKEN_ID, secret=SECRET)), "names no member API")]:
        with pytest.raises(BadToken, match=why):
            decode_token(bad)


def test_state_keeps_the_digest_expiry_and_uses_never_the_secret():
    state, (created,) = made(uses=2)
    assert isinstance(created, JoinTokenCreated)
    token = state.join_tokens[TOKEN_ID]
    assert (token.expires_at, token.uses_left, token.created_by) == (NOW + 3600, 2, "an admin")
    assert SECRET not in repr(state) and token.secret_sha256 == secret_digest(SECRET)
    assert "secret_sha256" not in describe(token)


def test_each_use_is_decided_once_and_a_spent_token_is_refused():
    state, _ = made(uses=2)
    state, (first,) = use(state, "node-a")
    state, (second,) = use(state, "node-b")
    assert isinstance(first, JoinTokenRedeemed) and isinstance(second, JoinTokenRedeemed)
    assert state.join_tokens[TOKEN_ID].uses_left == 0 and state.join_tokens[TOKEN_ID].redeemed_by == ["node-a", "node-b"]
    assert refusal(use(state, "node-c")[1]) == (
        "unauthorized", "this join token was used already: make another with `exo token create`")


def test_a_wrong_secret_an_unknown_id_and_an_expired_token_are_refused():
    state, _ = made()
    invalid = ("unauthorized", "this join token is not valid here (unknown to this cluster, or its secret is wrong)")
    assert refusal(use(state, "wrong", secret="t" * 43)[1]) == invalid
    assert refusal(use(state, "unknown", token_id="fedcba9876543210")[1]) == invalid
    assert refusal(use(state, "late", at=NOW + 3600)[1]) == (
        "unauthorized", "this join token has expired: make another with `exo token create`")
    assert state.join_tokens[TOKEN_ID].uses_left == 1


@pytest.mark.parametrize(("changes", "reason"), [
    ({"ttl_s": 10.0}, "ttl must be between 60 s and 30 days, not 10 s"),
    ({"uses": 0}, "uses must be between 1 and 100, not 0"),
    ({"token_id": "not-hex"}, "a join token's id is 16 hex digits and its digest a sha256"),
])
def test_a_token_out_of_bounds_is_refused(changes, reason):
    assert refusal(made(**changes)[1]) == ("invalid", reason)


def test_the_reducer_checks_a_use_itself_and_drops_expired_tokens_as_new_ones_come():
    state, _ = made()
    forged = JoinTokenRedeemed(token_id=TOKEN_ID, secret_sha256=secret_digest("t" * 43), at=NOW)
    after = apply(state, stamped(state, forged), state.last_seq + 1)
    assert after.join_tokens[TOKEN_ID].uses_left == 1 and after.skipped_events[-1].reason.startswith(
        "this join token is not valid here")
    later, _ = made(state, token_id="fedcba9876543210", at=NOW + 7200)  # the first expired an hour before
    assert list(later.join_tokens) == ["fedcba9876543210"]
    assert isinstance(later.join_tokens["fedcba9876543210"], JoinToken)
