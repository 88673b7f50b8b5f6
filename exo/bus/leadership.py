"""The master's lease: key `leader` in the KV bucket exo-leader, whose max age is the TTL.

Whoever creates the key holds the lease and renews it with compare-and-set updates; a key
nobody renews expires on the server and the next candidate can create it. The term is the
KV revision of that create: stream sequences only grow, so terms are monotonic.

The holder stops acting on its own well before the server could let someone else in: its
lease counts as valid only until `VALID_FRACTION` of the TTL after it *sent* the last
successful renewal. A process paused past that (SIGSTOP, a long GC) finds itself deposed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from exo.bus.subjects import LEADER_BUCKET, LEADER_KEY
from exo.core.ids import NodeId

log = logging.getLogger(__name__)

VALID_FRACTION = 0.6


class Lease:
    def __init__(self, nc: Client, node_id: NodeId, clock: Callable[[], float] = time.monotonic,
                 key: str = LEADER_KEY) -> None:
        self._js = nc.jetstream()
        self._key = key  # a master group's lease has a key of its own (exo/bus/subjects.py)
        self._node_id = node_id
        self._clock = clock
        self._revision = 0
        self._valid_until = 0.0
        self.term = 0
        self.ttl = 10.0

    async def try_acquire(self) -> int | None:
        """The new term if this node now holds the lease, else None."""
        kv = await self._js.key_value(LEADER_BUCKET)
        self.ttl = (await self._js.stream_info(f"KV_{LEADER_BUCKET}")).config.max_age or self.ttl
        value = json.dumps({"node_id": self._node_id}).encode()
        sent_at = self._clock()
        try:
            entry = await kv.get(self._key)
        except KeyNotFoundError:
            entry = None
        try:
            if entry is None:
                revision = await kv.create(self._key, value)
            elif json.loads(entry.value or b"{}").get("node_id") == self._node_id:
                revision = await kv.update(self._key, value, last=entry.revision)  # our own, from before a restart
            else:
                return None
        except KeyWrongLastSequenceError:
            return None  # another candidate won the race
        self._revision = self.term = revision
        self._valid_until = sent_at + self.ttl * VALID_FRACTION
        return revision

    async def renew(self) -> bool:
        if not self.valid():
            return False
        kv = await self._js.key_value(LEADER_BUCKET)
        sent_at = self._clock()
        try:
            self._revision = await kv.update(self._key, json.dumps({"node_id": self._node_id}).encode(), last=self._revision)
        except KeyWrongLastSequenceError:
            log.warning("lost the master lease (term %d): someone else holds it", self.term)
            self._valid_until = 0.0
            return False
        except Exception as error:  # a broker hiccup: the lease runs out unless a later renewal works
            log.warning("could not renew the master lease: %s", error)
            return self.valid()
        self._valid_until = sent_at + self.ttl * VALID_FRACTION
        return True

    def valid(self) -> bool:
        return self._clock() < self._valid_until

    async def release(self) -> None:
        """Hand the lease back at once, so another node need not wait for the TTL."""
        if not self.valid():
            return
        self._valid_until = 0.0
        try:
            kv = await self._js.key_value(LEADER_BUCKET)
            await kv.delete(self._key, last=self._revision)
        except Exception as error:  # it expires by itself anyway
            log.info("could not release the master lease: %s", error)
