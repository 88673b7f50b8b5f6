"""`exo inspect`: what NATS holds for exo, for machines without the `nats` CLI.

    exo inspect [--nats URL | --data-dir DIR] [--monitor http://127.0.0.1:8222] [--max-items 50] [--json]

Streams (messages, bytes, first / last sequence, time of the last message), every consumer
with its lag (messages not yet delivered to it), KV buckets with their keys (the State snapshot
says which sequence it covers), object stores with their objects, and with --monitor the
server's own figures from its HTTP monitoring endpoint.
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from exo.bus.catch_up import catch_up
from exo.bus.connection import Connection
from exo.bus.errors import BROKER_ERRORS
from exo.bus.tooling.inspection import Inspection, inspect_nats
from exo.core.node_names import server_display
from exo.core.state import State
from exo.settings.declare import value_of
from exo.settings.services import ToolSettings
from exo.tools.cli import EXIT_OK, Output, add_nats_option, open_nats, run_tool, table

NAMES_TIMEOUT_S = 10.0  # folding the log for the nodes' names: past this, servers keep their own names


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nats_option(parser)
    parser.add_argument("--monitor", default=value_of(ToolSettings, "nats_monitor_url") or None,
                        help="the server's HTTP monitoring URL, e.g. http://127.0.0.1:8222 (env EXO_NATS_MONITOR_URL)")
    parser.add_argument("--max-items", type=int, default=50, help="keys / objects shown per bucket (default 50)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return run_tool("inspect", _inspect(parse_args(argv)))


async def _inspect(args: argparse.Namespace) -> int:
    nc = await open_nats(args, "inspect")
    try:
        inspection = await inspect_nats(nc, args.monitor, args.max_items)
        state = await _state_for_names(nc) if any(s.cluster for s in inspection.streams) and not args.json else None
    finally:
        await nc.close()
    out = Output()
    if args.json:  # the servers' own names, as JetStream and the `nats` CLI give them
        out.raw(msgspec.json.encode(inspection) + b"\n")
    else:
        for line in inspection_text(inspection, state):
            out.line(line)
    out.flush()
    return EXIT_OK


async def _state_for_names(nc: Connection) -> State | None:
    """State, to name the cluster's servers after their nodes; None when the log cannot be read
    in NAMES_TIMEOUT_S (the servers keep their own names then)."""
    try:
        view, _ = await asyncio.wait_for(catch_up(nc), NAMES_TIMEOUT_S)
    except (TimeoutError, *BROKER_ERRORS):  # type: ignore[misc]  # a tuple of exception types
        return None
    await view.stop()
    return view.state


def inspection_text(inspection: Inspection, state: State | None = None) -> list[str]:
    """The report; with `state`, servers named after their nodes (exo/core/node_names.py)."""
    def named(server_name: str) -> str:  # "exo-<id> (offline)" -> "studio (offline)"
        name, _, note = server_name.partition(" ")
        return " ".join([server_display(state, name), *([note] if note else [])]) if state is not None else server_name

    server = inspection.server
    lines = [f"NATS {server.url} (nats-server {server.version}); JetStream stores "
             f"{_size(server.jetstream_storage_bytes)} on disk, {_size(server.jetstream_memory_bytes)} in memory"]
    if server.monitor:
        lines.append("server: " + ", ".join(f"{k}={v}" for k, v in server.monitor.items()))
    clustered = [s for s in inspection.streams if s.cluster]
    if clustered:
        servers = sorted({named(name.split(" ")[0]) for s in clustered for name in [s.leader, *s.followers] if name})
        lines += ["", f"JetStream cluster {clustered[0].cluster}: {len(servers)} server(s) hold streams: {', '.join(servers)}",
                  *table(["stream", "replicas", "leader", "followers"],
                          [[s.name, str(s.replicas), named(s.leader) if s.leader else "-",
                            ", ".join(map(named, s.followers)) or "-"] for s in clustered])]
    lines += ["", "Streams", *table(
        ["stream", "messages", "bytes", "first seq", "last seq", "last message", "consumers"],
        [[s.name, f"{s.messages:,}", _size(s.bytes), str(s.first_seq), str(s.last_seq), s.last_time or "-",
          str(len(s.consumers))] for s in inspection.streams])]
    consumers = [(s.name, c) for s in inspection.streams for c in s.consumers]
    lines += ["", "Consumers" if consumers else "Consumers: none"]
    if consumers:
        lines += table(
            ["stream", "consumer", "kind", "lag", "ack pending", "redelivered", "waiting pulls", "delivered seq",
             "ack floor"],
            [[stream, c.name, ("durable " if c.durable else "ephemeral ") + ("pull" if c.pull else "push"),
              f"{c.lag:,}", str(c.ack_pending), str(c.redelivered), str(c.waiting_pulls), str(c.delivered_seq),
              str(c.ack_floor_seq)] for stream, c in consumers])
    for bucket in inspection.buckets:
        lines += ["", f"KV bucket {bucket.bucket}: {bucket.values} value(s) kept, {_size(bucket.bytes)}"]
        lines += table(["key", "revision", "bytes", "revisions kept", "note"],
                        [[k.key, str(k.revision), _size(k.bytes), str(k.revisions_kept), k.note] for k in bucket.keys])
        if bucket.keys_left_out:
            lines.append(f"... and {bucket.keys_left_out} more key(s)")
    for store in inspection.object_stores:
        lines += ["", f"Object store {store.bucket}: {len(store.objects) + store.objects_left_out} object(s), "
                      f"{_size(store.bytes)}"]
        lines += table(["name", "size", "chunks", "modified", "digest"],
                        [[o.name, _size(o.size), str(o.chunks), _time(o.modified), o.digest] for o in store.objects])
        if store.objects_left_out:
            lines.append(f"... and {store.objects_left_out} more object(s)")
    return lines


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _time(rfc3339: str) -> str:
    return "-" if not rfc3339 or rfc3339.startswith("0001-") else rfc3339  # Go's zero time: never set
