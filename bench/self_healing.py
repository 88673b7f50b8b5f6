"""Self-healing (issue #29): from kill -9 of the node generating a streamed chat to its next
token, in one run for three placements side by side: a 1-node instance alone (replicas 1), a
1-node instance with a replica on another node (replicas 2: the generation moves to it at once),
and a 2-node pipeline instance losing its second rank.

By default a head (master and API, never killed) and three worker nodes on one nats-server
(`--cluster shared`): the worker dies whole (exo and its runners), and no master takeover is
mixed into the numbers. `--cluster discovered`: three discovered nodes, each with its own
nats-server (tests/support/healing.py); the node dies with its nats-server, and a sample whose
node held the master lease also waits for the takeover. The client reads from a node that
survives. Each sample is split where State shows it (polled every 50 ms from a survivor):

  detect   kill -> the task migrated or the instance deleted in State (EXO_SUSPECT_S, plus the
           master's takeover when the killed node held the master lease)
  place    -> a new instance of the desire in State (replicas 2: the task moves to the replica,
           the replacement comes along for the next failure)
  load     -> that instance's runners ready
  token    kill -> the next token of the running stream
  new req  kill -> a new (8-token) chat sent at the kill answered (retried while refused with 503)

Each sample ends by starting the killed node again (it rejoins). Medians with [min-max] and the
sample count; `master` counts samples whose killed node held the master lease.

    uv run python -m bench.self_healing [--samples 3] [--max-tokens 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal, TypedDict

import httpx

from exo.core.ids import InstanceId, TaskId
from exo.core.state import State
from tests.support.healing import (
    SUSPECT_S,
    Cluster,
    SharedNatsCluster,
    chat_body,
    kill_9,
    node_id_of,
    state_of,
    stream_chat,
    wait_until,
)
from tests.support.tiny_model import Dims, make_tiny_model


class Placement(TypedDict, total=False):
    """What /place_instance gets besides the model (healing.Cluster.place)."""

    replicas: int
    sharding: str
    min_nodes: int


Column = Literal["detect", "place", "load", "token", "new req"]
# One sample: seconds per column (None: not seen), or only ok/leader/errors when the sample failed.
Row = TypedDict("Row", {"ok": bool, "leader": bool, "errors": list[str], "detect": float | None, "place": float | None,
                        "load": float | None, "token": float | None, "new req": float | None}, total=False)


class NewRequest(TypedDict, total=False):
    """`new_request`'s outcome: refusals (503) before the answer, its status (or the error), when it came."""

    refused: int
    status: int | str
    at: float
    took: float


PROMPT = [{"role": "user", "content": "tell me about the sea"}]
SETUPS: list[tuple[str, Placement, int]] = [  # name, placement, rank to kill
    ("1 node, replicas 1", {}, 0),
    ("1 node, replicas 2", {"replicas": 2}, 0),
    ("2-node pipeline", {"sharding": "pipeline", "min_nodes": 2}, 1),
]
COLUMNS: list[Column] = ["detect", "place", "load", "token", "new req"]


class Watch:
    """Polls State on `api` and notes when each milestone of one failure first shows."""

    def __init__(self, api_url: str, task_id: TaskId, old_instance: InstanceId, desire_id: str,
                 others: set[InstanceId]) -> None:
        self.api_url, self.task_id, self.old, self.desire_id = api_url, task_id, old_instance, desire_id
        self.others = others  # instances of the desire before the kill, the old one included
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.seen) < 3:
            try:
                state = state_of_url(self.api_url)
            except (httpx.HTTPError, OSError):
                time.sleep(0.05)
                continue
            now = time.monotonic()
            task = state.tasks.get(self.task_id)
            if "detect" not in self.seen and ((task is not None and task.migrations) or self.old not in state.instances):
                self.seen["detect"] = now
            new = [i for i in state.instances.values() if i.desire_id == self.desire_id and i.instance_id not in self.others]
            if new and "place" not in self.seen:
                self.seen["place"] = now
            if new and "load" not in self.seen and all(
                    (r := state.runners.get(s.runner_id)) is not None and r.status == "ready" for s in new[0].shards):
                self.seen["load"] = now
            time.sleep(0.05)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return dict(self.seen)


def state_of_url(url: str) -> State:
    from exo.core.state import decode_state

    return decode_state(httpx.get(f"{url}/state", timeout=10).content)


def new_request(api_url: str, result: NewRequest) -> None:
    """A new chat sent at the kill, retried every 0.5 s while it is refused with 503 (the model's only
    instance failed or is being replaced: a client retries), up to 120 s."""
    started = time.monotonic()
    result["refused"] = 0
    while True:
        try:
            reply = httpx.post(f"{api_url}/v1/chat/completions", json=chat_body(PROMPT, 8), timeout=180)
            result["status"] = reply.status_code
        except httpx.HTTPError as error:
            result["status"] = repr(error)
        if result["status"] != 503 or time.monotonic() - started > 120:
            break
        result["refused"] += 1
        time.sleep(0.5)
    result["at"] = time.monotonic()
    result["took"] = result["at"] - started


def one_sample(cluster: Cluster, placement: Placement, victim_rank: int, max_tokens: int) -> Row:
    via = cluster.head if isinstance(cluster, SharedNatsCluster) else cluster.nodes[0]
    cluster.bring_back()
    cluster.clear(via)
    placed = cluster.place(via, **placement)
    instance_id = InstanceId(placed["instance_id"])
    state = cluster.state(via)
    desire_id = state.instances[instance_id].desire_id
    replicas = placement.get("replicas", 1)
    if replicas > 1:  # the rest of the replicas ready too
        wait_until(lambda: len([i for i in state_of(via).instances.values()
                                if i.desire_id == desire_id and cluster.ready(i.instance_id, via)])
                   >= replicas, 90, 0.2, "every replica ready")
        state = cluster.state(via)
    hosts = cluster.hosts(instance_id, via)
    victim = hosts[victim_rank]
    api = cluster.head if isinstance(cluster, SharedNatsCluster) else next(n for n in [*hosts, *cluster.nodes] if n is not victim)
    leader_killed = state.leader_node == node_id_of(victim)
    others = {i.instance_id for i in state.instances.values() if i.desire_id == desire_id}
    stream = stream_chat(api.url, chat_body(PROMPT, max_tokens))
    wait_until(lambda: stream.text_chunks() >= 20 or stream.done.is_set(), 60, 0.005, "the stream under way")
    assert not stream.done.is_set(), "the stream ended before the kill"
    watch = Watch(api.url, TaskId(stream.task_id), instance_id, desire_id, others)
    request: NewRequest = {}
    kill_9(victim)
    killed = time.monotonic()
    asker = threading.Thread(target=new_request, args=(api.url, request), daemon=True)
    asker.start()
    stream.done.wait(180)
    asker.join(180)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(watch.seen) < 3:
        time.sleep(0.1)
    seen = watch.stop()
    first = stream.first_text_after(killed)
    ok = stream.status == 200 and not stream.errors and stream.finish_reason == "length"
    row: Row = {"ok": ok and request.get("status") == 200, "leader": leader_killed,
           "errors": stream.errors[:1] + ([f"new request: {request.get('status')}"] if request.get("status") != 200 else [])}
    marks = {"detect": seen.get("detect"), "place": seen.get("place"), "load": seen.get("load")}
    row["detect"] = _since(marks["detect"], killed)
    row["place"] = _since(marks["place"], marks["detect"])
    row["load"] = _since(marks["load"], marks["place"])
    row["token"] = _since(first, killed)
    row["new req"] = _since(request.get("at"), killed) if request.get("status") == 200 else None
    return row


def _since(at: float | None, start: float | None) -> float | None:
    return None if at is None or start is None else max(0.0, at - start)


def _cell(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    spread = f" [{min(got):.1f}-{max(got):.1f}]" if len(got) > 1 else ""
    return f"{statistics.median(got):.1f}{spread} (n={len(got)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--setups", nargs="*", default=[name for name, _, _ in SETUPS])
    parser.add_argument("--keep", type=Path, help="keep the nodes' data dirs and logs in this (new) directory")
    parser.add_argument("--cluster", choices=["shared", "discovered"], default="shared")
    args = parser.parse_args()
    results: dict[str, list[Row]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model_dir = make_tiny_model(root / "model", Dims(layers=args.layers))
        kind = SharedNatsCluster if args.cluster == "shared" else Cluster
        cluster = kind(root, model_dir, env={"EXO_LOG_LEVEL": "INFO"})
        try:
            cluster.start()
            for name, placement, rank in SETUPS:
                if name not in args.setups:
                    continue
                rows = results.setdefault(name, [])
                for n in range(args.samples):
                    try:
                        rows.append(one_sample(cluster, placement, rank, args.max_tokens))
                    except AssertionError as error:
                        rows.append({"ok": False, "leader": False, "errors": [str(error)[:300]]})
                    print(f"{name} #{n + 1}: {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    nodes = "a head and 3 workers on one nats-server" if args.cluster == "shared" else "3 discovered nodes"
    print(f"{nodes} on one machine, EXO_SUSPECT_S={SUSPECT_S:g}, tiny model ({args.layers} layers), "
          f"a {args.max_tokens}-token greedy stream killed after 20 chunks; seconds, median [min-max] (n)")
    print("| setup | detect | place | load | next token | new request | ok | master killed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        cells = [_cell([r.get(c) for r in rows]) for c in COLUMNS]
        ok = sum(r["ok"] for r in rows)
        print(f"| {name} | " + " | ".join(cells) + f" | {ok}/{len(rows)} | {sum(r['leader'] for r in rows)} |")
    for name, rows in results.items():
        for row in rows:
            if row.get("errors"):
                print(f"{name}: {row['errors']}")


if __name__ == "__main__":
    main()
