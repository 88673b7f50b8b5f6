"""A worker node must keep up with the event log however much State has grown.

The 30-minute soak (docs/reliability.md) stopped completing chats after ~9 minutes while
commands still worked: its card loop had added a few thousand custom cards, and the worker
rewrote its whole custom-card folder (one TOML serialisation and one file read per card) on
every card event, on its event loop. Card events came faster than it could fold them, so the
worker's copy of State fell further and further behind the log and new chat tasks were
forwarded to the runner minutes late, then not at all before the client gave up.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.state_view import StateView
from exo.core.events import CustomCardAdded, CustomCardDeleted
from exo.core.state import State
from exo.core.types import ModelCard
from exo.models.cards import card_file_name, read_card
from exo.models.dirs import DownloadSettings
from exo.settings.services import ModelSettings
from exo.worker.service import Worker
from tests.conftest import eventually
from tests.support.as_master import TEST_TERM, with_leader

CARDS = 3000  # the soak had ~2,000 by the time chats stalled, 7,500 at its end
EVENTS = 50
BUDGET_S = 5.0  # 10 card events a second; the soak sent ~4 a second, besides chats


async def test_a_worker_folds_card_events_in_constant_time_whatever_the_number_of_cards(fresh_nats, tmp_path: Path):
    cards = {f"soak/m{n}": ModelCard(model_id=f"soak/m{n}", n_layers=2) for n in range(CARDS)}
    client = await connect([fresh_nats], name="t")
    view = worker = running = None
    try:
        await provision(client)
        view = StateView(client, with_leader(State(custom_model_cards=cards)))  # as if caught up from a snapshot
        await view.start()
        data_dir = tmp_path / "data"
        worker = Worker(client, view, "node-a", data_dir, [fresh_nats], {},
                        DownloadSettings.of(ModelSettings(model_sharing=False), data_dir))
        running = asyncio.create_task(worker.run())
        folder = worker.custom_cards_dir
        await eventually(lambda: len(list(folder.glob("*.toml"))) == CARDS, timeout=120)  # the start-up reconcile

        log = EventLog(client)
        changed = ModelCard(model_id="soak/m7", n_layers=5)
        events = [CustomCardAdded(card=ModelCard(model_id=f"soak/new{n}", n_layers=2), term=TEST_TERM)
                  for n in range(EVENTS - 3)]
        events += [CustomCardAdded(card=changed, term=TEST_TERM), CustomCardDeleted(model_id="soak/m8", term=TEST_TERM),
                   CustomCardDeleted(model_id="soak/never-added", term=TEST_TERM)]  # the last one the reducer skips
        started = time.perf_counter()
        for n, event in enumerate(events):
            last_seq = await log.append(event, f"card-event-{n}")
        await view.wait_for(last_seq, timeout=60)
        elapsed = time.perf_counter() - started
        assert elapsed < BUDGET_S, (
            f"{EVENTS} card events took {elapsed:.1f} s to fold with {CARDS} cards in State: the worker's work per "
            f"card event grows with the number of cards")

        wanted = {card_file_name(model_id) for model_id in view.state.custom_model_cards}
        assert {p.name for p in folder.glob("*.toml")} == wanted  # the folder is still equal to State
        assert read_card(folder / card_file_name("soak/m7")) == changed
        assert not (folder / card_file_name("soak/m8")).exists()
    finally:
        if running is not None:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        if worker is not None:
            await worker.stop()
        if view is not None:
            await view.stop()
        await client.close()
