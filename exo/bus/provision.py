"""Create the streams, buckets and the master's consumer from streams/*.json, idempotently.

The JSON files are nats-server's own config format, so `nats stream add --config` reads the
same files. We send them to the JetStream API unchanged: creating with an identical config is
a no-op on the server, and a different existing config is an error we surface, never overwrite,
except where it is exactly what an earlier release of these files made (EARLIER_LIMITS): that
stream is brought up to the file's limits, and the log says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from exo.bus.errors import BusError, ConfigMismatch
from exo.bus.jetstream_api import ClusterForming, jetstream_request
from exo.bus.stream_fit import FITTED_TO_DISK, create_fitting, fit_divisor
from exo.bus.subjects import COMMANDS_STREAM, EVENTS_STREAM, IMAGES_STREAM, MASTER_CONSUMER, LogNames
from exo.resources import streams_dir
from exo.settings.services import BusSettings

log = logging.getLogger(__name__)

_STREAM_IN_USE = 10058  # "stream name already in use with a different configuration"
# Deleting the last stream of an account (fit_divisor's probe) makes nats-server 2.15 remove the
# account's empty streams directory in the background, racing the next CREATE ("error creating
# store for stream", about 1 in 500 in a loop here): retried, then named.
_STORE_FAILED, _STORE_RETRIES = 10049, 3
_CONSUMER_EXISTS = 10148  # "consumer already exists" (with another config)
# A JetStream cluster still forming (a server not yet up or not yet a meta-group member) has no
# peers for a replicated stream: exo started with the cluster waits for it instead of exiting.
_NO_PEERS = 10005  # "no suitable peers for placement"
_CLUSTER_UNAVAILABLE = (10008, 10023, 10059)  # JetStream cluster not ready / no leader / stream not found yet


# Fields a discovered cluster sets by itself: replicas (raised to 3 at three nodes) and the first
# sequence of a log carried over from a standalone store (exo/bus/server/migration.py).
CLUSTER_MANAGED = ("num_replicas", "first_seq")

Overrides = dict[str, dict[str, Any]]  # stream name -> fields that replace the file's

# Limits that earlier releases of streams/*.json had, one dict per release. A stream that differs
# from its file in these fields only, and has exactly these values, was made by exo and never
# tuned by anyone: it is updated to the file. Anything else is an operator's choice: an error.
EARLIER_LIMITS: dict[str, list[dict[str, Any]]] = {
    IMAGES_STREAM: [{"max_bytes": -1}],  # before images were bounded by bytes
    EVENTS_STREAM: [{"allow_atomic": None}],  # before the master appended its batches atomically
}


def stream_configs(
    folder: Path | None = None, replicas: int | None = None, overrides: Overrides | None = None
) -> list[dict[str, Any]]:
    folder = folder or streams_dir()
    configs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if replicas is not None:
        configs = [{**c, "num_replicas": replicas} for c in configs]
    overrides = overrides or {}
    return [{**c, **overrides.get(c["name"], {})} for c in configs]


def event_retention(max_age_s: float | None, max_bytes: int | None) -> Overrides:
    """Bounds for the event log (snapshots are what make trimming it safe)."""
    fields: dict[str, Any] = {}
    if max_age_s is not None:
        fields["max_age"] = int(max_age_s * 1e9)
    if max_bytes is not None:
        fields["max_bytes"] = max_bytes
    return {EVENTS_STREAM: fields} if fields else {}


def consumer_configs(folder: Path | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(stream name, consumer config) pairs; files are named <STREAM>.<durable>.json."""
    folder = (folder or streams_dir()) / "consumers"
    return [(p.name.split(".", 1)[0], json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def placed_on(tags: list[str]) -> Overrides:
    """Streams placed on servers with these tags only (a discovered cluster: real nodes, never its witness)."""
    return {c["name"]: {"placement": {"tags": tags}} for c in stream_configs()}


async def provision(nc: Client, replicas: int | None = None, overrides: Overrides | None = None,
                    keep_replicas: bool = False, forming_wait_s: float = BusSettings().cluster_forming_wait_s) -> None:
    """keep_replicas: an existing stream's replica count is the cluster's business (a discovered
    cluster raises it to 3 by itself), not a difference from the file. A cluster still forming is
    waited for `forming_wait_s` (EXO_CLUSTER_FORMING_WAIT_S)."""
    deadline = time.monotonic() + forming_wait_s
    while True:
        try:
            return await _provision_once(nc, replicas, overrides, keep_replicas)
        except ClusterForming as forming:
            if time.monotonic() > deadline:
                raise BusError(f"{forming}; the JetStream cluster did not form within {forming_wait_s:g} s") from None
            log.warning("%s: waiting for the JetStream cluster's servers", forming)
            await asyncio.sleep(1.0)


async def _provision_once(nc: Client, replicas: int | None, overrides: Overrides | None, keep_replicas: bool) -> None:
    configs = stream_configs(replicas=replicas, overrides=overrides)
    infos = [await jetstream_request(nc, f"$JS.API.STREAM.INFO.{c['name']}", {}) for c in configs]
    missing = [c for c, info in zip(configs, infos, strict=True) if info.get("error")]
    divisor = await fit_divisor(nc, missing)  # the missing share the disk alike
    for config, info in zip(configs, infos, strict=True):
        if info.get("error"):
            await _create_stream(nc, config, keep_replicas, divisor)
        else:  # never CREATE an existing stream again: on a small disk the server checks the storage
            await _check_existing(nc, config, info.get("config", {}), keep_replicas)  # reservation first
    for stream, config in consumer_configs():
        await _create_consumer(nc, stream, config)


def group_configs(names: LogNames) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A master group's event and command streams and its master's consumer: the shared ones'
    files (streams/EXO_EVENTS.json, ...) with the group's names and subjects."""
    shared = {c["name"]: c for c in stream_configs()}
    events = {**shared[EVENTS_STREAM], "name": names.events_stream, "subjects": [names.all_events],
              "description": f"master group {names.group}'s event log: its models' requests (exo/core/groups.py)"}
    commands = {**shared[COMMANDS_STREAM], "name": names.commands_stream, "subjects": [names.all_commands],
                "description": f"requests to master group {names.group}'s master"}
    consumer = next(c for stream, c in consumer_configs() if stream == COMMANDS_STREAM and c["durable_name"] == MASTER_CONSUMER)
    return [events, commands], {**consumer, "filter_subject": names.all_commands}


async def group_streams(nc: Client) -> list[str]:
    """The master groups' streams on this server (EXO_EVENTS_<group>, EXO_COMMANDS_<group>), sorted:
    a discovered cluster replicates them, and a migration carries their logs, as it does the shared ones."""
    names: list[str] = []
    while True:
        reply = await jetstream_request(nc, "$JS.API.STREAM.NAMES", {"offset": len(names)})
        page = reply.get("streams") or []
        names += page
        if not page or len(names) >= reply.get("total", 0):
            break
    prefixes = (f"{EVENTS_STREAM}_", f"{COMMANDS_STREAM}_")
    return sorted(n for n in names if n.startswith(prefixes))


async def provision_group(nc: Client, names: LogNames) -> None:
    """Create a master group's streams and consumer, idempotently (the shared master does before it
    names the group in the log; every follower checks them before reading)."""
    configs, consumer = group_configs(names)
    # Placed and replicated like the shared log (a discovered cluster: on real nodes, R3 once it has three).
    shared = (await jetstream_request(nc, f"$JS.API.STREAM.INFO.{EVENTS_STREAM}", {})).get("config") or {}
    like = {key: shared[key] for key in ("placement", "num_replicas") if key in shared}
    configs = [{**config, **like} for config in configs]
    infos = [await jetstream_request(nc, f"$JS.API.STREAM.INFO.{c['name']}", {}) for c in configs]
    missing = [c for c, info in zip(configs, infos, strict=True) if info.get("error")]
    divisor = await fit_divisor(nc, missing) if missing else 1
    for config, info in zip(configs, infos, strict=True):
        if info.get("error"):
            await _create_stream(nc, config, True, divisor)
        else:
            await _check_existing(nc, config, info.get("config", {}), True)
    await _create_consumer(nc, names.commands_stream, consumer)


async def _create_stream(nc: Client, config: dict[str, Any], keep_replicas: bool, divisor: int) -> None:
    """Make a stream that was missing (and check it, if another node made it meanwhile)."""
    name = config["name"]
    reply = await create_fitting(nc, config, divisor)
    for _ in range(_STORE_RETRIES):
        if (reply.get("error") or {}).get("err_code") != _STORE_FAILED:
            break
        log.warning("stream %s: %s; trying again", name, reply["error"].get("description"))
        await asyncio.sleep(0.5)
        reply = await create_fitting(nc, config, divisor)
    error = reply.get("error")
    if error and error.get("err_code") == _STREAM_IN_USE:  # made by another node meanwhile
        existing = (await jetstream_request(nc, f"$JS.API.STREAM.INFO.{name}", {})).get("config", {})
        await _check_existing(nc, config, existing, keep_replicas)
        return
    if error and (error.get("err_code") == _NO_PEERS or error.get("err_code") in _CLUSTER_UNAVAILABLE
                  or error.get("code") == 503):
        raise ClusterForming(f"cannot create stream {name} yet: {error.get('description')}")
    if error:
        raise BusError(f"cannot create stream {name}: {error.get('description', error)}")


async def _check_existing(nc: Client, config: dict[str, Any], existing: dict[str, Any], keep_replicas: bool) -> None:
    name = config["name"]
    differing = {key for key, value in config.items() if existing.get(key) != value}
    if keep_replicas:  # the cluster's business: a discovered cluster raises replicas by itself
        differing -= set(CLUSTER_MANAGED)
    if "max_bytes" in differing and (existing.get("metadata") or {}).get(FITTED_TO_DISK):
        differing.discard("max_bytes")  # exo made it smaller to fit its disk (below); an operator's change is an error
    if not differing or await _upgrade_stream(nc, config, existing, differing):
        return
    raise ConfigMismatch(
        f"stream {name} already exists with a configuration different from streams/{name}.json "
        f"(in {', '.join(sorted(differing))}); compare with `nats stream info {name}` and update or remove it deliberately"
    )


async def _upgrade_stream(nc: Client, config: dict[str, Any], existing: dict[str, Any], differing: set[str]) -> bool:
    """Update a stream that an earlier release made to the file's limits; False if it is not one."""
    name = config["name"]
    earlier = next((limits for limits in EARLIER_LIMITS.get(name, []) if differing and differing <= limits.keys()
                    and all(existing.get(key) == limits[key] for key in differing)), None)
    if earlier is None:
        return False
    reply = await jetstream_request(nc, f"$JS.API.STREAM.UPDATE.{name}", config)
    if reply.get("error"):
        raise BusError(f"cannot update stream {name} to streams/{name}.json: {reply['error'].get('description')}")
    changes = ", ".join(f"{key} {existing.get(key)} -> {config[key]}" for key in sorted(differing))
    log.info("stream %s, made by an earlier release, updated to streams/%s.json: %s", name, name, changes)
    return True


async def _create_consumer(nc: Client, stream: str, config: dict[str, Any]) -> None:
    durable = config["durable_name"]
    request = {"stream_name": stream, "config": config, "action": "create"}
    reply = await jetstream_request(nc, f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", request)
    error = reply.get("error")
    if error and error.get("err_code") == _CONSUMER_EXISTS:
        raise ConfigMismatch(
            f"consumer {stream}/{durable} already exists with a different configuration; "
            f"compare with `nats consumer info {stream} {durable}`"
        )
    if error:
        raise BusError(f"cannot create consumer {stream}/{durable}: {error.get('description', error)}")

