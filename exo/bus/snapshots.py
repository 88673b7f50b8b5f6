"""State snapshots in the KV bucket exo-state, key `snapshot`.

The value is the State as JSON (readable with `nats kv get exo-state snapshot`); its
`last_seq` is the event sequence it covers. The bucket keeps the last 16 revisions, which
`exo replay --verify` compares with a fresh replay. Writes use the KV revision as an
expected-last-sequence, so a slow writer can never put an older snapshot over a newer one.

The leading master signs each one with its node key (exo/bus/chunk_signing.py, over the key's
subject and the value), in the message's headers: the value stays the State JSON. A reader uses
it only if the log shows the signer leading (exo/core/snapshot_trust.py).
"""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue

from exo.bus.chunk_signing import SIGNATURE_HEADER, SIGNER_HEADER, ChunkSigner, signature_valid
from exo.bus.jetstream_api import get_stored
from exo.bus.server.embedded import MAX_PAYLOAD_BYTES
from exo.bus.snapshot_signers import read_snapshot_signers
from exo.bus.subjects import SHARED, STATE_BUCKET, LogNames, snapshot_subject
from exo.core.ids import NodeId
from exo.core.snapshot_trust import SnapshotSigners, snapshot_refusal, unverifiable
from exo.core.state import State, decode_state, encode_state

log = logging.getLogger(__name__)

STATE_STREAM = f"KV_{STATE_BUCKET}"  # the bucket's stream (nats-py's KV layout)
KV_OPERATION_HEADER = "KV-Operation"  # DEL or PURGE on a deleted revision
HEADERS_ROOM = 512  # NATS counts headers in max_payload: the signature's and the expected sequence's


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
    """The newest snapshot that can be trusted, or None. One that does not decode, claims a
    sequence the log has not reached (a forged or corrupt value: a node starting from it would
    wait for events that never come), or is not signed by a master the log shows (see
    exo/core/snapshot_trust.py) is passed over for an older revision."""
    latest = await _stored(nc, names)
    if latest is None:
        return None
    log_first, log_last = await _log_bounds(nc, names)
    signers = await read_snapshot_signers(nc, names, log_first) if latest.value else SnapshotSigners()
    if unverifiable(signers):
        log.warning("%s starts at sequence %d, past every election: the snapshot's signer cannot be checked, "
                    "so it is used unchecked (a new election, by a failover or a master restart, ends this)",
                    names.events_stream, log_first)
    state, problem = _usable(latest, log_last, names, signers)
    if problem is None:
        return state
    log.warning("snapshot revision %d not used: %s; trying older revisions", latest.revision, problem)
    for entry in reversed(await snapshot_entries(nc, names=names)):
        older = await _stored(nc, names, entry.revision) if (entry.revision or 0) < latest.revision else None
        if older is None:
            continue
        state, problem = _usable(older, log_last, names, signers)
        if problem is None:
            log.info("starting from snapshot revision %d (sequence %d)", older.revision, state.last_seq if state else 0)
            return state
        log.warning("snapshot revision %d not used: %s", older.revision, problem)
    return None


class _Stored(msgspec.Struct, frozen=True, kw_only=True):
    """One revision of a snapshot key as stored, with its signature headers."""

    revision: int
    value: bytes  # b"": deleted or purged
    signer: str = ""
    signature: str = ""


async def _stored(nc: Client, names: LogNames, revision: int | None = None) -> _Stored | None:
    """The latest revision of the log's snapshot key (or the given one); None if it has none. Read
    as a raw message: nats-py's KV entries leave the headers out."""
    subject = snapshot_subject(names)
    try:
        if revision:
            msg = await get_stored(nc.jetstream(), STATE_STREAM, seq=revision)
        else:
            msg = await get_stored(nc.jetstream(), STATE_STREAM, subject=subject)
    except NotFoundError:
        return None
    if msg.subject != subject:
        return None
    headers = msg.headers or {}
    deleted = headers.get(KV_OPERATION_HEADER) in ("DEL", "PURGE")
    return _Stored(revision=msg.seq or 0, value=b"" if deleted else (msg.data or b""),
                   signer=headers.get(SIGNER_HEADER, ""), signature=headers.get(SIGNATURE_HEADER, ""))


def _usable(stored: _Stored, log_last: int, names: LogNames,
            signers: SnapshotSigners) -> tuple[State | None, str | None]:
    """(State, None) for a value a node may start from; (None, None) for a deleted one; else the problem."""
    if not stored.value:
        return None, None
    if refusal := snapshot_refusal(signers, stored.signer, bool(stored.signature)):
        return None, refusal
    if stored.signature and not signature_valid(signers.keys[NodeId(stored.signer)], snapshot_subject(names),
                                                stored.value, stored.signature):
        return None, f"its signature does not verify with node {stored.signer}'s key (changed after it was signed?)"
    try:
        state = decode_state(stored.value)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return None, f"it does not decode ({error})"
    if state.group != names.group:  # a group's snapshot under another's key: it folded another log
        return None, f"it is master group {state.group!r}'s State, not {names.group!r}'s"
    if state.last_seq > log_last:
        return None, f"it claims sequence {state.last_seq}, beyond the log's last sequence {log_last}"
    return state, None


async def _log_bounds(nc: Client, names: LogNames = SHARED) -> tuple[int, int]:
    """The log's first and last stored sequences (first 0: it holds nothing)."""
    state = (await nc.jetstream().stream_info(names.events_stream)).state
    return (state.first_seq if state.messages else 0), state.last_seq


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
            stored = await nc.jetstream().stream_info(STATE_STREAM, subjects_filter=snapshot_subject(names))
            if not stored.state.messages:
                return []
    log.warning("the history of %s.%s came back empty %d times while the stream holds it", STATE_BUCKET,
                names.snapshot_key, attempts)
    return []


async def write_snapshot(nc: Client, state: State, attempts: int = 5, names: LogNames = SHARED,
                         signer: ChunkSigner | None = None) -> bool:
    """Store `state`, signed by `signer` (the leading master's node key; None: unsigned, as an older
    master), unless the bucket already has a usable one at least as new. True if written."""
    payload = encode_state(state)
    if len(payload) + HEADERS_ROOM > nc.max_payload:
        log.error("State at sequence %d is %d bytes, over this NATS server's max_payload of %d: "
                  "no snapshot written; raise max_payload in the server's config (the embedded server uses %d)",
                  state.last_seq, len(payload), nc.max_payload, MAX_PAYLOAD_BYTES)
        return False
    for _ in range(attempts):
        current = await _stored(nc, names)
        if current is not None and current.value and covered_seq(current.value) >= state.last_seq:
            log_first, log_last = await _log_bounds(nc, names)
            _, problem = _usable(current, log_last, names, await read_snapshot_signers(nc, names, log_first))
            if problem is None:
                return False
            log.warning("replacing snapshot revision %d: %s", current.revision, problem)
        try:
            await _put(nc, names, payload, current.revision if current is not None else 0, signer)
            return True
        except KeyWrongLastSequenceError:
            continue  # another writer got there first: look again
    log.warning("gave up writing the snapshot at sequence %d after %d races", state.last_seq, attempts)
    return False


async def _put(nc: Client, names: LogNames, payload: bytes, last: int, signer: ChunkSigner | None) -> None:
    """Publish as nats-py's KV update does (the revision as an expected last sequence), with the
    signature in headers: nats-py's KV API takes none."""
    subject = snapshot_subject(names)
    headers: dict[str, str] = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(last)}
    if signer is not None:
        headers |= signer.headers(subject, payload)
    try:
        await nc.jetstream().publish(subject, payload, headers=headers)
    except APIError as error:
        if error.err_code in (10071, 10164):  # wrong last sequence
            raise KeyWrongLastSequenceError(description=error.description) from None
        raise
