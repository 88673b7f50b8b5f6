"""State snapshots in the KV bucket exo-state, key `snapshot`.

The value is the State as JSON (readable with `nats kv get exo-state snapshot`); its
`last_seq` is the event sequence it covers. The bucket keeps the last 16 revisions, which
`exo replay --verify` compares with a fresh replay. Writes use the KV revision as an
expected-last-sequence, so a slow writer can never put an older snapshot over a newer one.
"""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from exo.bus.server.embedded import MAX_PAYLOAD_BYTES
from exo.bus.subjects import SHARED, STATE_BUCKET, LogNames
from exo.core.state import State, decode_state, encode_state

log = logging.getLogger(__name__)


class _CoveredSeq(msgspec.Struct):
    last_seq: int = 0


def covered_seq(snapshot: bytes) -> int:
    """The sequence a stored snapshot covers, without building the whole State (0 for a value
    that is not a snapshot, e.g. one written by hand: the next snapshot replaces it)."""
    try:
        return msgspec.json.decode(snapshot, type=_CoveredSeq).last_seq
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0


async def read_latest_snapshot(nc: Client, names: LogNames = SHARED) -> State | None:
    """The newest snapshot that can be trusted, or None. One that does not decode, or claims a
    sequence the log has not reached (a forged or corrupt value: a node starting from it would
    wait for events that never come), is passed over for an older revision."""
    kv = await nc.jetstream().key_value(STATE_BUCKET)
    try:
        entry = await kv.get(names.snapshot_key)
    except KeyNotFoundError:
        return None
    log_last = await _log_last_seq(nc, names)
    state, problem = _usable(entry.value, log_last, names)
    if problem is None:
        return state
    log.warning("snapshot revision %d not used: %s; trying older revisions", entry.revision, problem)
    for older in reversed(await snapshot_entries(nc, names=names)):
        if (older.revision or 0) >= (entry.revision or 0):
            continue
        state, problem = _usable(older.value, log_last, names)
        if problem is None:
            log.info("starting from snapshot revision %d (sequence %d)", older.revision, state.last_seq if state else 0)
            return state
        log.warning("snapshot revision %d not used: %s", older.revision, problem)
    return None


def _usable(value: bytes | None, log_last: int, names: LogNames) -> tuple[State | None, str | None]:
    """(State, None) for a value a node may start from; (None, None) for a deleted one; else the problem."""
    if not value:
        return None, None
    try:
        state = decode_state(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return None, f"it does not decode ({error})"
    if state.group != names.group:  # a group's snapshot under another's key: it folded another log
        return None, f"it is master group {state.group!r}'s State, not {names.group!r}'s"
    if state.last_seq > log_last:
        return None, f"it claims sequence {state.last_seq}, beyond the log's last sequence {log_last}"
    return state, None


async def _log_last_seq(nc: Client, names: LogNames = SHARED) -> int:
    return (await nc.jetstream().stream_info(names.events_stream)).state.last_seq


async def snapshot_history(nc: Client, names: LogNames = SHARED) -> list[State]:
    """Every snapshot the bucket still holds, oldest first."""
    return [decode_state(e.value) for e in await snapshot_entries(nc, names=names) if e.value]


async def snapshot_entries(nc: Client, attempts: int = 5, names: LogNames = SHARED) -> list[KeyValue.Entry]:
    """The key's history. nats-py's `history` can come back empty when its consumer's messages are
    delivered before it reads the consumer's info (seen on a loaded machine): empty while the
    stream holds revisions of the key is read again."""
    kv = await nc.jetstream().key_value(STATE_BUCKET)
    for _ in range(attempts):
        try:
            return await kv.history(names.snapshot_key)
        except (KeyNotFoundError, NoKeysError):
            stored = await nc.jetstream().stream_info(f"KV_{STATE_BUCKET}",
                                                      subjects_filter=f"$KV.{STATE_BUCKET}.{names.snapshot_key}")
            if not stored.state.messages:
                return []
    log.warning("the history of %s.%s came back empty %d times while the stream holds it", STATE_BUCKET,
                names.snapshot_key, attempts)
    return []


async def write_snapshot(nc: Client, state: State, attempts: int = 5, names: LogNames = SHARED) -> bool:
    """Store `state` unless the bucket already has one at least as new. True if written."""
    kv = await nc.jetstream().key_value(STATE_BUCKET)
    payload = encode_state(state)
    if len(payload) > nc.max_payload:
        log.error("State at sequence %d is %d bytes, over this NATS server's max_payload of %d: "
                  "no snapshot written; raise max_payload in the server's config (the embedded server uses %d)",
                  state.last_seq, len(payload), nc.max_payload, MAX_PAYLOAD_BYTES)
        return False
    for _ in range(attempts):
        try:
            entry = await kv.get(names.snapshot_key)
        except KeyNotFoundError:
            entry = None
        try:
            if entry is None:
                await kv.create(names.snapshot_key, payload)
                return True
            if entry.value and covered_seq(entry.value) >= state.last_seq:
                _, problem = _usable(entry.value, await _log_last_seq(nc, names), names)
                if problem is None:
                    return False
                log.warning("replacing snapshot revision %d: %s", entry.revision, problem)
            await kv.update(names.snapshot_key, payload, last=entry.revision)
            return True
        except KeyWrongLastSequenceError:
            continue  # another writer got there first: look again
    log.warning("gave up writing the snapshot at sequence %d after %d races", state.last_seq, attempts)
    return False
