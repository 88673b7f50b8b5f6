"""What every API surface shares: the NATS connection, State, the card catalogue, outcomes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from nats.aio.client import Client

from exo.api.outcomes import CommandOutcomes
from exo.bus.state_view import StateView
from exo.core.types import ModelCard
from exo.master.decide import find_card


@dataclass
class ApiContext:
    nc: Client
    view: StateView
    outcomes: CommandOutcomes
    builtin_cards: Mapping[str, ModelCard]
    node_id: str
    data_dir: Path

    def card(self, model_id: str) -> ModelCard | None:
        return find_card(self.view.state, self.builtin_cards, model_id)

    def all_cards(self) -> dict[str, ModelCard]:
        return {**self.builtin_cards, **self.view.state.custom_model_cards}


CONTEXT_KEY = web.AppKey("exo_context", ApiContext)


def context_of(request: web.Request) -> ApiContext:
    return request.app[CONTEXT_KEY]
