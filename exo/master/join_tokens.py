"""The master's decisions on join tokens (pure): made by an admin, used once per use by new nodes
(exo/core/join_tokens.py). The master decides uses one command at a time, so a single-use token
admits one node however many present it at once."""

from __future__ import annotations

from exo.core.commands import CreateJoinToken, RedeemJoinToken, command_tag
from exo.core.events import CommandRejected, Event, JoinTokenCreated, JoinTokenRedeemed
from exo.core.join_tokens import JoinToken, create_problem, redeem_problem
from exo.core.state import State


def create_join_token(state: State, command: CreateJoinToken) -> list[Event]:
    if (problem := create_problem(command.token_id, command.secret_sha256, command.ttl_s, command.uses,
                                  state.join_tokens)) is not None:
        return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code="invalid",
                                reason=problem)]
    token = JoinToken(token_id=command.token_id, secret_sha256=command.secret_sha256,
                      expires_at=command.at + command.ttl_s, uses_left=command.uses, created_at=command.at,
                      created_by=command.created_by)
    return [JoinTokenCreated(command_id=command.command_id, token=token)]


def redeem_join_token(state: State, command: RedeemJoinToken) -> list[Event]:
    if (problem := redeem_problem(state.join_tokens, command.token_id, command.secret_sha256, command.at)) is not None:
        return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code="unauthorized",
                                reason=problem)]
    return [JoinTokenRedeemed(command_id=command.command_id, token_id=command.token_id,
                              secret_sha256=command.secret_sha256, node_name=command.node_name, at=command.at)]
