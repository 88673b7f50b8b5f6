"""On-demand placement: time from a chat request to its first token for a model that has no
instance (cold: weights on disk, nothing loaded) vs one already loaded (warm), and the cost of an
eviction: the same cold request for model B when idle model A fills the node's memory and must be
unloaded first. One node (the `exo` process) with a fake Hub serving two generated tiny models.

How A fills memory honestly: the node reports its real free memory (MemAvailable) and no setting
lowers what placement may use, so A, whose config allows a context of 2^27 tokens, is placed with
POST /place_instance, a keep_alive (so it is evictable, not pinned) and a max_context whose KV
cache reservation takes the reported free memory but for half of what B's smallest placement
needs (its weights and 2,048 tokens of context). Placement counts reservations, not resident
bytes, so B no longer fits and the master unloads A to place it (nodes with up to 64 GiB free).
A's runner holds a tiny model, not gigabytes: the unload measured is the control path and a
runner's exit, not the freeing of large weights. Should the node's report rise between A's
placement and B's request, B fits beside A: that sample is dropped and said so.

Each sample is split where State shows it (polled every 50 ms) and timed from the request:
  placed  the model's instance in State: the master's decision (evicting: A's instance and runner
          leave State in that same decision; its process stops while B's starts)
  token   the first streamed text (the rest is the runner's start and load, and the first step)
Setups alternate run by run (forwards, then backwards). Medians [min-max] (n samples); a sample
is kept for "evicting idle A" only if the node's log says A was evicted for it.

    uv run python -m bench.on_demand [--samples 5] [--max-tokens 8]   (1.5-3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.summary import alternating
from exo.core.ids import ModelId
from exo.core.kv_budget import CONTEXT_STEP, MIN_AUTO_CONTEXT, kv_bytes_per_token
from exo.core.state import State
from exo.master.eviction import evicted_reason
from tests.support.cluster import state_of_url
from tests.support.e2e import start_exo
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.polling import wait_until
from tests.support.tiny_model import Dims, make_tiny_model

MODEL_A, MODEL_B = ModelId("exo-bench/tiny-a-long-context"), ModelId("exo-bench/tiny-b")
LONG_CONTEXT = 1 << 27  # the most a card may say (CARD_LIMITS)
SETUPS = ["cold", "warm", "cold, evicting idle A"]
COLUMNS = ["placed", "token"]
SETTLE_S = 1.0  # before a cold request: what the unload or A's load set going has ended, in both setups alike
EVICTED_LINE = evicted_reason(MODEL_B)  # in the master's INFO line for each desire it unloads
Sample = dict[str, float]


def long_context_model(path: Path) -> Path:
    """The tiny model with as many KV heads as heads (512 bytes of KV cache a token: LONG_CONTEXT
    tokens fill 64 GiB), its config saying it takes a context of LONG_CONTEXT tokens."""
    make_tiny_model(path, Dims(kv_heads=4))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    return path


def loaded_instance_of(state: State, model: ModelId) -> tuple[bool, bool]:
    """(an instance of the model is in State, every runner of it is ready)."""
    instances = [i for i in state.instances.values() if i.model_id == model]
    ready = bool(instances) and all((r := state.runners.get(s.runner_id)) is not None and r.status == "ready"
                                    for s in instances[0].shards)
    return bool(instances), ready


def wait_loaded(url: str, model: ModelId, timeout: float) -> None:
    wait_until(lambda: loaded_instance_of(state_of_url(url), model)[1], timeout, 0.1, f"{model} loaded")


class PlacementWatch:
    """Polls State while a request runs and notes when the model's instance shows."""

    def __init__(self, url: str, model: ModelId, started: float) -> None:
        self.url, self.model, self.started = url, model, started
        self.seen: Sample = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and "placed" not in self.seen:
            try:
                if loaded_instance_of(state_of_url(self.url), self.model)[0]:
                    self.seen["placed"] = time.monotonic() - self.started
            except (httpx.HTTPError, OSError):
                pass
            self._stop.wait(0.05)

    def stop(self) -> Sample:
        self._stop.set()
        self._thread.join(10)
        return dict(self.seen)


def timed_chat(http: httpx.Client, model: ModelId, max_tokens: int) -> Sample:
    """One streamed greedy chat: seconds from the request to its instance in State and to its first text."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True}
    started = time.monotonic()
    watch = PlacementWatch(str(http.base_url).rstrip("/"), model, started)
    token: float | None = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if token is None and line.startswith("data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {}).get("content")
                token = time.monotonic() - started if delta else None
    sample = watch.stop()
    assert token is not None, f"no text came back from {model}"
    sample["token"] = token
    return sample


def runner_processes(node: ExoProcess) -> list[int]:
    """Pids of the node's runner processes (`python -m exo.runner`, its children)."""
    assert node.process is not None
    children = [int(pid) for task in Path(f"/proc/{node.process.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    return [pid for pid in children if _cmdline(pid).endswith("\0-m\0exo.runner\0")]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # it exited meanwhile
        return ""


def unload_everything(node: ExoProcess, http: httpx.Client) -> None:
    """Delete every desire and wait until no instance is left and every runner process has exited
    (State drops an instance's runners when it deletes the instance, before their processes stop)."""
    for desire_id in state_of_url(node.url).desires:
        http.delete(f"/desire/{desire_id}")
    wait_until(lambda: not state_of_url(node.url).instances and not runner_processes(node), 60, 0.1,
               "every model unloaded")


def fill_memory_with_a(http: httpx.Client) -> None:
    """Place A, idle and evictable, with a KV reservation that leaves B too little room (module doc)."""
    url = str(http.base_url).rstrip("/")
    for _ in range(5):  # the node's report may move between reading it and placing: read it again
        state = state_of_url(url)
        (node,) = state.nodes.values()
        card_a, card_b = state.custom_model_cards[MODEL_A], state.custom_model_cards[MODEL_B]
        least_b = card_b.storage_bytes + kv_bytes_per_token(card_b) * MIN_AUTO_CONTEXT
        reservation = node.memory_available - card_a.storage_bytes - least_b / 2
        tokens = int(reservation / kv_bytes_per_token(card_a)) // CONTEXT_STEP * CONTEXT_STEP
        placed = http.post("/place_instance", json={"model_id": MODEL_A, "max_context": min(tokens, LONG_CONTEXT),
                                                    "keep_alive": "10m"})
        if placed.status_code == 200:
            wait_loaded(url, MODEL_A, 60)
            return
        print(f"placing A: {placed.status_code} {placed.text[:200]}; trying again", file=sys.stderr)
    raise AssertionError("A could not be placed to fill the node's memory")


def one_sample(node: ExoProcess, http: httpx.Client, setup: str, max_tokens: int) -> Sample | None:
    """One timed request in `setup`, from the state it needs; None: A was not evicted (B had room)."""
    if setup == "warm":
        if not loaded_instance_of(state_of_url(node.url), MODEL_B)[1]:
            unload_everything(node, http)
            timed_chat(http, MODEL_B, 2)  # loads B on demand; it stays for its keep_alive
        sample = timed_chat(http, MODEL_B, max_tokens)
        return {"placed": 0.0, "token": sample["token"]}
    unload_everything(node, http)
    if setup == "cold":
        time.sleep(SETTLE_S)
        return timed_chat(http, MODEL_B, max_tokens)
    fill_memory_with_a(http)
    time.sleep(SETTLE_S)
    evictions_before = node.output().count(EVICTED_LINE)
    sample = timed_chat(http, MODEL_B, max_tokens)
    deadline = time.monotonic() + 5  # the master's log line may trail the stream a little
    while node.output().count(EVICTED_LINE) == evictions_before:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return sample


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    spread = f" [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread} (n={len(values)})"


def add_cards(http: httpx.Client) -> None:
    for model in (MODEL_A, MODEL_B):
        http.post("/models/add", json={"model_id": model}).raise_for_status()


def run(root: Path, samples: int, max_tokens: int, progress: Callable[[str], None]) -> dict[str, list[Sample]]:
    hub = FakeHub({MODEL_A: long_context_model(root / "a"), MODEL_B: make_tiny_model(root / "b")})
    hub.start()
    (root / "node").mkdir()
    node = start_exo(root / "node", hub, {"EXO_LOG_LEVEL": "INFO", "EXO_DISCOVERY": "0"})  # one node, never another run's cluster
    results: dict[str, list[Sample]] = {setup: [] for setup in SETUPS}
    try:
        with httpx.Client(base_url=node.url, timeout=180) as http:
            add_cards(http)
            for model in (MODEL_A, MODEL_B):  # download both once, untimed: cold means "weights on disk"
                http.post("/place_instance", json={"model_id": model}).raise_for_status()
                wait_loaded(node.url, model, 120)
            for n, setup in alternating(SETUPS, samples):
                sample = one_sample(node, http, setup, max_tokens)
                progress(f"{setup} #{n + 1}: {sample if sample is not None else 'B fit beside A: no eviction, dropped'}")
                if sample is not None:
                    results[setup].append(sample)
    finally:
        node.interrupt()
        hub.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(Path(tmp), args.samples, args.max_tokens, lambda line: print(line, file=sys.stderr, flush=True))
    print(f"one node, tiny generated models from a fake Hub, a {args.max_tokens}-token greedy stream; seconds from "
          f"the request, median [min-max] (n); whole run {time.monotonic() - started:.0f} s")
    print("| setup | instance placed | first token |")
    print("|---|---|---|")
    for setup, rows in results.items():
        print(f"| {setup} | " + " | ".join(cell([r[c] for r in rows if c in r]) for c in COLUMNS) + " |")
    cold, evicting = (statistics.median(r["token"] for r in results[s]) if results[s] else None
                      for s in ("cold", "cold, evicting idle A"))
    if cold is not None and evicting is not None:
        print(f"eviction's cost on the first token: {evicting - cold:+.2f} s ({evicting / cold:.2f}x the cold start)")


if __name__ == "__main__":
    main()
