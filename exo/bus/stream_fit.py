"""Streams that fit the disk JetStream has.

JetStream takes 75% of the disk that is free when it starts and reserves each stream's
`max_bytes` from it. On a small disk the limits of streams/*.json (14 GiB together) do not fit:
the streams still missing are made alike smaller, by the power of two that lets all of them fit
(found with a probe stream of their total), rather than the first ones taking everything and the
last being refused. A stream made smaller is marked in its metadata (FITTED_TO_DISK: the file's
value), so that a restart accepts it, and the log says so with both sizes.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from nats.aio.client import Client

from exo.bus.jetstream_api import jetstream_request

log = logging.getLogger(__name__)

NO_STORAGE = 10047  # "insufficient storage resources available"
MIN_STREAM_BYTES = 64 << 20  # a stream smaller than this is no use: refuse with the numbers instead
FITTED_TO_DISK = "exo_fitted_to_disk"  # stream metadata: exo lowered max_bytes from the file's (this value)


async def fit_divisor(nc: Client, missing: list[dict[str, Any]]) -> int:
    """The power of two by which the missing streams' max_bytes must shrink for all to fit (1: as they are)."""
    wanted = sum(c["max_bytes"] for c in missing if c.get("max_bytes", -1) > 0)
    if wanted <= 0:
        return 1
    tag = uuid.uuid4().hex[:8]
    probe = {"name": f"EXO_PROBE_{tag}", "subjects": [f"exo.probe.{tag}"], "storage": "file",
             "num_replicas": missing[0].get("num_replicas", 1), **({"placement": missing[0]["placement"]}
                                                                    if "placement" in missing[0] else {})}
    divisor = 1
    while wanted // divisor >= MIN_STREAM_BYTES:
        reply = await jetstream_request(nc, f"$JS.API.STREAM.CREATE.{probe['name']}", {**probe, "max_bytes": wanted // divisor})
        error = reply.get("error")
        if not error:
            await jetstream_request(nc, f"$JS.API.STREAM.DELETE.{probe['name']}", {})
            return divisor
        if error.get("err_code") != NO_STORAGE:
            return 1  # not a question of room (a cluster still forming...): creating says what it is
        divisor *= 2
    return divisor


async def create_fitting(nc: Client, config: dict[str, Any], divisor: int = 1) -> dict[str, Any]:
    """CREATE the stream at its file's max_bytes shrunk by `divisor`; if there is still no room,
    halve it until it fits, down to MIN_STREAM_BYTES, and say so."""
    name, wanted = config["name"], config.get("max_bytes", -1)
    attempt = _shrunk(config, max(MIN_STREAM_BYTES, wanted // divisor)) if wanted > 0 and divisor > 1 else dict(config)
    while True:
        reply = await jetstream_request(nc, f"$JS.API.STREAM.CREATE.{name}", attempt)
        error = reply.get("error") or {}
        if error.get("err_code") != NO_STORAGE or not attempt.get("max_bytes", -1) > 0:
            break
        if attempt["max_bytes"] // 2 < MIN_STREAM_BYTES:
            reply["error"]["description"] = (
                f"{error.get('description')}: JetStream has no room on its disk for this stream even at "
                f"{_gib(MIN_STREAM_BYTES)} (streams/{name}.json asks {_gib(wanted)}); free space on the NATS "
                f"server's store disk, or give JetStream a bigger disk")
            return reply
        attempt = _shrunk(config, attempt["max_bytes"] // 2)
    if attempt.get("max_bytes") != wanted and not reply.get("error"):
        log.warning("stream %s made with max_bytes %s instead of streams/%s.json's %s: the NATS server's disk "
                    "has no room for more; it keeps that limit (raise it with `nats stream edit %s --max-bytes` "
                    "once there is room)", name, _gib(attempt["max_bytes"]), name, _gib(wanted), name)
    return reply


def _shrunk(config: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    return {**config, "max_bytes": max_bytes,
            "metadata": {**config.get("metadata", {}), FITTED_TO_DISK: str(config["max_bytes"])}}


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"
