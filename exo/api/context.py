"""What every API surface shares: the NATS connection, State, the card catalogue, outcomes."""

from __future__ import annotations

import asyncio
import difflib
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from exo.api.errors import ApiError
from exo.api.metrics import Metrics
from exo.api.outcomes import CommandOutcomes
from exo.api.state_metrics import ClusterCollector
from exo.background import Background
from exo.bus.chunk_gate import ChunkGate
from exo.bus.connection import Connection, max_payload
from exo.bus.publish import RETRY_FOR_S, publish_patience
from exo.bus.state_view import FoldedView
from exo.core.catalogue import find_card
from exo.core.ids import ModelId, NodeId
from exo.core.types import ModelCard
from exo.models.dirs import ModelDirs
from exo.settings.services import ApiSettings, ModelSettings

COMMAND_ROOM_BYTES = 64 * 1024  # a generation command's fields besides the request's text, with room to spare


def closest_model_id(asked: str, known: list[str]) -> str | None:
    """The known id a typo most likely meant: the same but for case, else the same name in another
    org, else the closest spelling."""
    if len(asked) > 200:  # no model id is that long: nothing to suggest, and no time spent comparing it
        return None
    lower = {k.lower(): k for k in known}
    if asked.lower() in lower:
        return lower[asked.lower()]
    name = asked.rsplit("/", 1)[-1].lower()
    same_name = [k for k in known if k.rsplit("/", 1)[-1].lower() == name]
    if same_name:
        return sorted(same_name)[0]
    close = difflib.get_close_matches(asked.lower(), list(lower), n=1, cutoff=0.75)
    return lower[close[0]] if close else None


@dataclass
class ApiContext:
    nc: Connection
    view: FoldedView
    outcomes: CommandOutcomes
    builtin_cards: Mapping[ModelId, ModelCard]
    node_id: NodeId
    data_dir: Path
    settings: ApiSettings = field(default_factory=ApiSettings)
    metrics: Metrics = field(default_factory=Metrics)
    # Cancels waiting out the resume grace of a dropped stream, by command id (this node only).
    pending_cancels: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    # Open readers (streams, resumed or not) of each generation on this node: a grace timer
    # cancels only a generation nobody reads, here or on another API node (exo/bus/readers.py).
    readers: Counter[str] = field(default_factory=Counter)
    # Why this node's NATS cannot store anything now (its embedded server's disk is full), or None.
    storage_problem: Callable[[], str | None] = lambda: None
    # (the cluster's secret, a member's cluster address) where this node is a member of a discovered
    # cluster with a secret, for join tokens (exo/api/cluster/join_tokens.py); None: not such a member.
    cluster_join: Callable[[], tuple[str, str] | None] = lambda: None
    _background: Background = field(default_factory=lambda: Background("api"))
    cluster_metrics: ClusterCollector = field(init=False)
    models: ModelSettings = field(default_factory=ModelSettings)
    model_dirs: ModelDirs = field(init=False)  # where this node keeps models: /models/add looks there offline
    chunk_gate: ChunkGate = field(init=False)  # admits only chunks signed by the node running their run

    def __post_init__(self) -> None:
        self.model_dirs = ModelDirs.of(self.models, self.data_dir)  # as the worker reads them
        self.chunk_gate = ChunkGate(lambda: self.view.state)
        self.cluster_metrics = ClusterCollector(lambda: self.view.state, per_key=self.settings.metrics_per_key)
        self.metrics.registry.register(self.cluster_metrics)

    def card(self, model_id: ModelId) -> ModelCard | None:
        return find_card(self.view.state, self.builtin_cards, model_id)

    def require_card(self, model_id: ModelId) -> ModelCard:
        """The card, or the OpenAI-style 404 every surface answers for an unknown model."""
        card = self.card(model_id)
        if card is None:
            raise self.unknown_model(model_id, "model", f"The model {model_id!r} does not exist")
        return card

    def card_or_404(self, model_id: ModelId, param: str = "model_id") -> ModelCard:
        """The card, or exo's own routes' 404, with a suggestion."""
        card = self.card(model_id)
        if card is None:
            raise self.unknown_model(model_id, param, f"unknown model {model_id!r}")
        return card

    def unknown_model(self, model_id: str, param: str, message: str, known: Sequence[str] | None = None) -> ApiError:
        """`known`: the ids the hint may name (default: every card's)."""
        near = closest_model_id(model_id, list(self.all_cards() if known is None else known))
        hint = f"; did you mean {near!r}?" if near else ""
        return ApiError(404, f"{message}{hint} (GET /v1/models lists the models; POST /models/add adds one)",
                        param=param, code="model_not_found")

    def in_background(self, coroutine: Coroutine[Any, Any, object]) -> None:
        self._background.start(_with_service_patience(coroutine))

    def all_cards(self) -> dict[ModelId, ModelCard]:
        return {**self.builtin_cards, **self.view.state.custom_model_cards}

    def body_limit(self) -> int:
        """The largest request body: EXO_MAX_BODY_BYTES, else what one NATS message of the connected
        server carries less room for the command's own fields (a request's text goes in one command)."""
        return self.settings.max_body_bytes or max(max_payload(self.nc) - COMMAND_ROOM_BYTES, COMMAND_ROOM_BYTES)


CONTEXT_KEY = web.AppKey("exo_context", ApiContext)


def context_of(request: web.Request) -> ApiContext:
    return request.app[CONTEXT_KEY]


async def _with_service_patience(coroutine: Coroutine[Any, Any, object]) -> object:
    """Work a request leaves behind (a cancel after the client left) outlives its client: it
    publishes with the services' patience, not the shorter one its request's context carried."""
    publish_patience.set(RETRY_FOR_S)  # this task's own copy of the context
    return await coroutine
