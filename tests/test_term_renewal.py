"""A master that leads longer than EXO_MASTER_TERM_RENEW_S elects itself again (exo/master/service.py),
so the event log, trimmed by age, always holds an election: a starting node can check who signed
the snapshot (docs/deploy.md, "Signed snapshots"), instead of taking it unchecked. Requests keep
being answered exactly through the renewals. (A log trimmed in seconds cannot be made here: the
stream's duplicate window, 2 minutes, must fit in its age; the latest election's age is what matters.)"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.snapshots import read_latest_snapshot
from exo.bus.subjects import EVENTS_STREAM, event_subject
from tests.support.cluster import state_of
from tests.support.e2e import Reference, exo_serving, place
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

RENEW_S = 1.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ExoProcess]:
    env = {"EXO_MASTER_TERM_RENEW_S": str(RENEW_S), "EXO_SNAPSHOT_INTERVAL": "1"}
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir}, env) as exo:
        yield exo


def test_the_master_renews_its_term_and_every_request_is_answered_exactly(node, model_dir):
    reference = Reference(model_dir)
    with httpx.Client(base_url=node.url, timeout=120) as http:
        place(http, TINY_MODEL_ID)
        terms, leaders = set(), set()
        deadline = time.monotonic() + 4 * RENEW_S
        n = 0
        while time.monotonic() < deadline or len(terms) < 3:
            assert time.monotonic() < deadline + 30, f"terms seen: {sorted(terms)}"
            content = f"renewal {n}: tell me about the sea"
            answer = http.post("/v1/chat/completions", json={
                "model": TINY_MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "temperature": 0})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == reference.chat(
                [{"role": "user", "content": content}], 8)
            state = state_of(node)
            terms.add(state.leader_term)
            leaders.add(state.leader_node)
            n += 1
    assert len(leaders) == 1 and len(terms) >= 3, (leaders, terms)
    assert "renewing its term" in node.output()


async def test_the_logs_latest_election_is_never_older_than_the_renewal(node, caplog):
    """EXO_EVENTS trims by age (30 days): an election younger than that is always in it, and a
    starting node checks the snapshot's signer against it (no "past every election")."""
    caplog.set_level(logging.WARNING, logger="exo.bus.snapshots")
    nc = await connect([node.nats_url()], name="renewal-test")
    try:
        js = nc.jetstream()
        for _ in range(3):
            await asyncio.sleep(RENEW_S)
            latest = await js.get_last_msg(EVENTS_STREAM, event_subject("leader.elected"))
            assert latest.headers is not None or latest.data
            age = time.time() - _stamp(latest)
            assert age < RENEW_S + 3, f"the latest election is {age:.1f} s old"
        assert await read_latest_snapshot(nc) is not None
        assert "past every election" not in caplog.text and "not used" not in caplog.text, caplog.text
    finally:
        await nc.close()


def _stamp(message: object) -> float:
    """A stored message's time (nats-py's RawStreamMsg has it as an RFC 3339 string)."""
    import datetime

    text = str(getattr(message, "time", "")).replace("Z", "+00:00")
    whole, _, rest = text.partition(".")
    fraction, _, zone = rest.partition("+")
    return datetime.datetime.fromisoformat(f"{whole}.{fraction[:6]}+{zone or '00:00'}").timestamp()
