"""The API node's check of token chunks before they reach a client (exo/bus/chunk_signing.py): a
chunk passes only if the node that signed it runs the chunk's run of the task, by State, and its
signature verifies against that node's key in State. A forged chunk is dropped and logged once
per (task, claimed publisher): it can neither add text to the stream nor end it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from exo.bus.chunk_signing import SIGNATURE_HEADER, SIGNER_HEADER, signature_valid
from exo.core.chunk_signers import chunk_refusal, may_run_unseen, run_signers
from exo.core.ids import CommandId, NodeId, TaskId
from exo.core.state import State

log = logging.getLogger(__name__)

# How long a chunk waits for this node's State to show its run (the runner's view can be ahead of
# ours: a task just created or moved) before it is refused.
STATE_LAG_S = 3.0
_POLL_S = 0.02
_LOGGED_KEPT = 4096  # (task, publisher) pairs remembered for log-once; then the memory starts over


class _Run(msgspec.Struct):
    """The run a chunk claims (read leniently: the signature decides whether to believe it)."""

    attempt: int = 0


_run_decoder = msgspec.json.Decoder(_Run)


class ChunkGate:
    def __init__(self, state: Callable[[], State], state_lag_s: float = STATE_LAG_S) -> None:
        self._state = state
        self._state_lag_s = state_lag_s
        self._logged: set[tuple[str, str]] = set()
        self._waited_out: set[tuple[str, int]] = set()  # (task, run) State never showed: later chunks do not wait
        self.dropped = 0  # chunks refused since start (a test and /metrics can read it)

    async def admits(self, command_id: CommandId, subject: str, payload: bytes, headers: dict[str, str] | None) -> bool:
        headers = headers or {}
        signer, signature = headers.get(SIGNER_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
        reason = await self._refusal(TaskId(command_id), subject, payload, signer, signature)
        if not reason:
            return True
        self.dropped += 1
        publisher = signer or "(unsigned)"
        if (command_id, publisher) not in self._logged:
            if len(self._logged) >= _LOGGED_KEPT:
                self._logged.clear()
            self._logged.add((command_id, publisher))
            log.warning("dropped a forged token chunk of task %s claiming publisher %s: %s", command_id, publisher, reason)
        return False

    async def _refusal(self, task_id: TaskId, subject: str, payload: bytes, signer: str, signature: str) -> str:
        try:
            attempt = _run_decoder.decode(payload).attempt
        except (msgspec.DecodeError, msgspec.ValidationError):
            attempt = 0  # unreadable: judged as run 0's, and its signature still decides
        signers = run_signers(self._state(), task_id, attempt)  # the common case: State shows the run
        if signers is None:
            if not self._worth_waiting_for(subject, payload, signer, signature):
                return f"State shows no run {attempt} of this task, and no node of its instances signed it"
            signers = await self._signers(task_id, attempt)
        if signers is None:
            return f"State shows no run {attempt} of this task (after {self._state_lag_s:.0f} s)"
        refusal = chunk_refusal(signers, signer, bool(signature))
        if refusal or not signature:
            return refusal
        if not signature_valid(signers[NodeId(signer)], subject, payload, signature):
            return f"its signature does not verify against node {signer}'s key"
        return ""

    def _worth_waiting_for(self, subject: str, payload: bytes, signer: str, signature: str) -> bool:
        """A run State does not show yet, but may soon (see may_run_unseen): only then may a chunk wait."""
        state = self._state()
        if not may_run_unseen(state, signer, bool(signature)):
            return False
        return not signature or signature_valid(state.nodes[NodeId(signer)].public_key, subject, payload, signature)

    async def _signers(self, task_id: TaskId, attempt: int) -> dict[NodeId, str] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (0.0 if (task_id, attempt) in self._waited_out else self._state_lag_s)
        # A short poll: rare (only while this node's State lags the runner's), and a view's listeners cannot be removed.
        while (signers := run_signers(self._state(), task_id, attempt)) is None and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        if signers is None:
            if len(self._waited_out) >= _LOGGED_KEPT:
                self._waited_out.clear()
            self._waited_out.add((task_id, attempt))
        return signers
