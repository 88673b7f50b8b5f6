"""Soak: mixed load against the compose topology (3 NATS servers, an API node, two workers, as
local processes). Every --fault-every seconds the NATS server that leads the event stream is
killed (kill -9) and kept down for --restart-after seconds, longer than the recovery allowed: only
the other replicas can serve in between, so a cluster without replication fails.
At the end it checks, and exits 1 unless all hold (each printed PASS or FAIL):
- every stream and bucket has 3 replicas;
- after each kill, a chat and a card command *started after the kill* succeed within
  --max-recovery seconds of it (while the killed server is still down);
- every whole window of --window seconds has at least --min-rate (a fraction) of the median
  window's successful chats (a slow decline that follows the load shows here);
- no request fails (5xx, connection error) except within --explained-after-fault s of a kill;
- every card command answered 200 is in the final State;
- every 25th chat (greedy) equals mlx-lm's text for the same prompt;
- State equals a replay of the log, and no request hung.

    uv run python -m bench.soak --duration 1800 --fault-every 180   # the report's run
    uv run python -m bench.soak --duration 90 --fault-every 44 --restart-after 24   # CI's run (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from exo.bus.connection import connect
from exo.core.state import State
from tests.support.cluster import replay, state_of_url
from tests.support.compose_topology import LocalTopology
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

REQUEST_TIMEOUT_S = 60
SAMPLE_EVERY = 25  # every 25th chat's text is compared with mlx-lm's
MAX_TOKENS = 16

T = TypeVar("T")
Fault = tuple[str, float]  # (the killed server's compose name, when it was killed)
Check = tuple[bool, str]  # (passed, what was checked)


def chat_body(n: int) -> dict[str, Any]:
    return {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": f"soak {n}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


class Criteria:
    """What a soak must show to pass (argparse sets them)."""

    replicas: int = 3  # compose.yaml's --replicas
    window_s: float = 30.0
    min_rate: float = 0.4  # of the median window's successful chats (a window may hold a whole recovery)
    max_recovery_s: float = 20.0  # kill to the first success sent after it (observed: 0-10 s; 16 s beside other tests)
    explained_after_fault_s: float = 20.0  # a failed request this soon after a kill is the fault's


class Load:
    """Chats and custom-card commands in two bounded loops on loopback."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self.started = time.monotonic()
        self.outcomes: list[tuple[float, str, str]] = []  # (finished at, kind, outcome)
        self.started_at: list[float] = []  # when each of `outcomes` was sent
        self.cards_answered: list[str] = []  # custom cards whose command was answered 200
        self.texts: dict[int, str] = {}  # every SAMPLE_EVERY-th chat's text, by chat number
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in ("chat", "card")]

    def _loop(self, kind: str) -> None:
        with httpx.Client(base_url=self.api_url, timeout=REQUEST_TIMEOUT_S) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                sent = time.monotonic()
                try:
                    if kind == "chat":
                        response = http.post("/v1/chat/completions", json=chat_body(n))
                        if response.status_code == 200 and n % SAMPLE_EVERY == 0:
                            self.texts[n] = response.json()["choices"][0]["message"]["content"]
                    else:
                        response = http.post("/models/add", json={"model_id": f"soak/m{n}", "n_layers": 2})
                        if response.status_code == 200:
                            self.cards_answered.append(f"soak/m{n}")
                        time.sleep(0.2)
                    outcome = "ok" if response.status_code == 200 else f"http {response.status_code}"
                except httpx.TimeoutException:
                    outcome = "hung"
                    print(f"[{time.monotonic() - self.started:6.0f} s] {kind} {n} hung ({REQUEST_TIMEOUT_S} s)", flush=True)
                except httpx.HTTPError as error:
                    outcome = f"error {type(error).__name__}"
                    time.sleep(0.2)
                self.started_at.append(sent)  # before its outcome: the two lists stay aligned for readers
                self.outcomes.append((time.monotonic(), kind, outcome))

    def first_ok_sent_after(self, moment: float, kind: str) -> float | None:
        """Seconds from `moment` to the end of the first success sent after it: a request in flight
        at a kill may finish on a connection the kill did not touch, so it proves nothing."""
        sent = list(zip(self.started_at, self.outcomes))
        return next((at - moment for start, (at, k, o) in sent if start > moment and k == kind and o == "ok"), None)


def run(duration: float, fault_every: float, restart_after: float, root: Path) -> bool:
    hub = FakeHub({TINY_MODEL_ID: make_tiny_model(root / "model")})
    endpoint = hub.start()
    topology = LocalTopology(root / "compose", {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        topology.start()
        with httpx.Client(base_url=topology.api_url, timeout=120) as http:
            http.post("/models/add", json={"model_id": TINY_MODEL_ID}).raise_for_status()
            http.post("/place_instance", json={"model_id": TINY_MODEL_ID}).raise_for_status()
        load = Load(topology.api_url)
        for thread in load.threads:
            thread.start()
        faults = inject_faults(topology, load, duration, fault_every, restart_after)
        load.stop.set()
        for thread in load.threads:
            thread.join(REQUEST_TIMEOUT_S + 10)
        return report(topology, load, faults, root / "model")
    finally:
        topology.stop()
        hub.stop()


def inject_faults(topology: LocalTopology, load: Load, duration: float, every: float, restart_after: float) -> list[Fault]:
    started = time.monotonic()
    faults: list[Fault] = []
    while time.monotonic() - started + every <= duration:
        time.sleep(every - restart_after)
        name = stream_leader(topology, "EXO_EVENTS")
        process = topology.services[name].process
        assert process is not None, f"{name} is not running"
        process.kill()
        killed_at = time.monotonic()
        print(f"[{killed_at - started:6.0f} s] kill -9 {name}", flush=True)
        time.sleep(restart_after)
        topology.services[name] = topology.nats_service(name).start()
        faults.append((name, killed_at))
    time.sleep(max(0.0, duration - (time.monotonic() - started)))
    return faults


def stream_leader(topology: LocalTopology, stream: str) -> str:
    """The compose name of the server leading `stream` now (with one replica: the one holding it)."""

    async def ask() -> str | None:
        nc = await connect(topology.nats_urls, name="soak-reader")
        try:
            cluster = (await nc.jetstream().stream_info(stream)).cluster
            assert cluster is not None, f"{stream}: no cluster info"
            return cluster.leader  # None while it elects one
        finally:
            await nc.close()

    leader = ask_with_retries(ask)
    assert leader is not None, f"{stream} has no leader"
    return leader


def replication_check(topology: LocalTopology) -> Check:
    async def ask() -> dict[str, int]:
        nc = await connect(topology.nats_urls, name="soak-reader")
        try:
            replicas: dict[str, int] = {}
            for info in await nc.jetstream().streams_info():
                name, count = info.config.name, info.config.num_replicas
                assert name is not None and count is not None, info  # the server sends both for every stream
                replicas[name] = count
            return replicas
        finally:
            await nc.close()

    replicas = ask_with_retries(ask)
    return (bool(replicas) and all(r >= Criteria.replicas for r in replicas.values()),
            f"every stream and bucket has {Criteria.replicas} replicas: {dict(sorted(replicas.items()))}")


def ask_with_retries(ask: Callable[[], Coroutine[Any, Any, T]], attempts: int = 5) -> T:
    for attempt in range(attempts):
        try:
            return asyncio.run(ask())
        except Exception:  # a server just restarted may not answer the first time
            if attempt == attempts - 1:
                raise
            time.sleep(1)
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def state_differences(live: State, replayed: State) -> list[str]:
    """Which fields differ, and for maps the first few keys that do: where to start looking."""
    found: list[str] = []
    for field in live.__struct_fields__:
        mine, theirs = getattr(live, field), getattr(replayed, field)
        if mine == theirs:
            continue
        if isinstance(mine, dict):
            keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))[:3]
            found.append(f"{field} {[(k, mine.get(k), theirs.get(k)) for k in keys]}")
        else:
            found.append(field)
    return found


def report(topology: LocalTopology, load: Load, faults: list[Fault], model_dir: Path) -> bool:
    quiet_since, last, give_up = time.monotonic(), -1, time.monotonic() + 15
    # Let in-flight events settle: 3 s without one, or 15 s (two workers' heartbeats, 5 s apart
    # each, may never leave 3 s of quiet; the replay below stops at the live State's sequence).
    while time.monotonic() - quiet_since < 3 and time.monotonic() < give_up:
        seq = state_of_url(topology.api_url).last_seq
        quiet_since, last = (quiet_since, last) if seq == last else (time.monotonic(), seq)
        time.sleep(0.5)
    live = state_of_url(topology.api_url)
    replayed, _ = replay(topology.nats_urls, live.last_seq)
    counts: dict[str, int] = {}
    for _, kind, outcome in load.outcomes:
        key = f"{kind} {outcome.split()[0]}"
        counts[key] = counts.get(key, 0) + 1
    print(f"\nrequests: {dict(sorted(counts.items()))}")
    checks: list[Check] = [replication_check(topology), *recovery_checks(load, faults), chat_rate_check(load),
              unexplained_failures_check(load, faults)]
    hung = sum(1 for _, _, o in load.outcomes if o == "hung")
    equal = replayed == live
    if not equal:
        print(f"State differs from the replay in: {state_differences(live, replayed)}")
    print(f"events: {live.last_seq}; custom cards: {len(live.custom_model_cards)}; State equals a replay of the log: "
          f"{equal}; hung requests: {hung}")
    lost = [card for card in load.cards_answered if card not in live.custom_model_cards]
    checks.append((not lost, f"every card command answered 200 is in State: {len(load.cards_answered) - len(lost)} of "
                             f"{len(load.cards_answered)}" + (f" (missing {lost[:3]})" if lost else "")))
    checks.append(exact_text_check(load, model_dir))
    checks += [(equal, "State equals a replay of the log"), (hung == 0, f"no request hung ({hung})")]
    for passed, what in checks:
        print(f"{'PASS' if passed else 'FAIL'}: {what}")
    return all(passed for passed, _ in checks)


def recovery_checks(load: Load, faults: list[Fault]) -> list[Check]:
    checks: list[Check] = []
    for name, killed_at in faults:
        chat, card = load.first_ok_sent_after(killed_at, "chat"), load.first_ok_sent_after(killed_at, "card")
        slowest = max(chat if chat is not None else float("inf"), card if card is not None else float("inf"))
        checks.append((slowest <= Criteria.max_recovery_s,
                       f"kill -9 {name}: first chat sent after it ok after {chat or float('nan'):.1f} s, first "
                       f"command {card or float('nan'):.1f} s (at most {Criteria.max_recovery_s:.0f} s)"))
    return checks


def chat_rate_check(load: Load) -> Check:
    # A slow decline here, rather than a step at a fault, points at something that grows with
    # the load (the stall of docs/reliability.md's first 30-minute run was one). The floor is
    # relative to this run's own median, so it means the same on a fast and a slow machine.
    ended = max((at for at, _, _ in load.outcomes), default=load.started)
    per_window = [0] * (int((ended - load.started) // Criteria.window_s) + 1)
    for at, kind, outcome in load.outcomes:
        if kind == "chat" and outcome == "ok":
            per_window[int((at - load.started) // Criteria.window_s)] += 1
    whole = per_window[:-1] or per_window  # the last window is cut short by the end of the load
    floor = Criteria.min_rate * statistics.median(whole)
    return (min(whole) >= floor and floor > 0,
            f"chats ok per {Criteria.window_s:.0f} s: {per_window} (each whole window at least "
            f"{Criteria.min_rate:.0%} of their median, {floor:.0f})")


def unexplained_failures_check(load: Load, faults: list[Fault]) -> Check:
    failed = [(at, kind, o) for at, kind, o in load.outcomes if o != "ok"]
    unexplained = [(round(at - load.started, 1), kind, o) for at, kind, o in failed
                   if not any(0 <= at - killed_at <= Criteria.explained_after_fault_s for _, killed_at in faults)]
    return (not unexplained, f"failed requests: {len(failed)}, all within {Criteria.explained_after_fault_s:.0f} s "
                             f"of a kill" if not unexplained else f"failed requests no fault explains: {unexplained[:5]}")


def exact_text_check(load: Load, model_dir: Path) -> Check:
    from tests.support.e2e import Reference

    reference = Reference(model_dir)
    wrong = [n for n, text in sorted(load.texts.items())
             if text != reference.chat(chat_body(n)["messages"], MAX_TOKENS)]
    return (bool(load.texts) and not wrong,
            f"greedy chats equal to mlx-lm's: {len(load.texts) - len(wrong)} of {len(load.texts)} sampled"
            + (f" (differ: chats {wrong[:5]})" if wrong else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800)
    parser.add_argument("--fault-every", type=float, default=180)
    parser.add_argument("--restart-after", type=float, default=30,
                        help="seconds a killed server stays down (more than --max-recovery)")
    parser.add_argument("--keep", type=Path, help="keep every process's log and store in this folder")
    parser.add_argument("--window", type=float, default=Criteria.window_s, help="seconds per throughput window")
    parser.add_argument("--min-rate", type=float, default=Criteria.min_rate,
                        help="each whole window's successful chats, as a fraction of the median window's")
    parser.add_argument("--max-recovery", type=float, default=Criteria.max_recovery_s,
                        help="seconds from a kill to the next successful chat and command")
    parser.add_argument("--explained-after-fault", type=float, default=Criteria.explained_after_fault_s,
                        help="seconds after a kill in which failed requests are the kill's")
    args = parser.parse_args()
    if args.restart_after <= args.max_recovery or args.fault_every <= args.restart_after:
        parser.error("need --max-recovery < --restart-after < --fault-every: a server must stay down past the recovery")
    Criteria.window_s, Criteria.min_rate, Criteria.max_recovery_s = args.window, args.min_rate, args.max_recovery
    Criteria.explained_after_fault_s = args.explained_after_fault
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        sys.exit(0 if run(args.duration, args.fault_every, args.restart_after, args.keep) else 1)
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(0 if run(args.duration, args.fault_every, args.restart_after, Path(tmp)) else 1)
