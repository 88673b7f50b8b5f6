"""The leading shared master's sweep of exo-adapters: weights that no adapter in State names any
more are deleted. An adapter's weights normally leave the object store with it (the API node that
took the DELETE removes them once the master deletes the adapter); if that node stopped first, or an
upload never became an adapter, nothing else would, and the bucket fills until uploads are refused.

The choice is pure (exo/master/adapters.py's orphan_weights); this is its shell: list, decide,
check State again just before each deletion, delete. A failure is logged and tried at the next sweep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from exo.bus.adapters import delete_adapter, stored_adapter_weights
from exo.bus.connection import Connection
from exo.core.state import State
from exo.master.adapters import orphan_weights

log = logging.getLogger(__name__)

FIRST_SWEEP_S = 10.0  # after the lease is won: a new master finishes what an old one or a lost API node left


async def sweep_adapter_weights_while(leading: Callable[[], bool], nc: Connection, state: Callable[[], State],
                                      every_s: float, grace_s: float) -> None:
    """Sweep FIRST_SWEEP_S after the start, then every `every_s`, while `leading()`."""
    await asyncio.sleep(min(FIRST_SWEEP_S, every_s))
    while leading():
        try:
            await sweep_once(nc, state, grace_s)
        except Exception as error:  # noqa: BLE001 - the broker's errors or a malformed object: the next sweep tries again
            log.warning("master: the adapter weights were not swept (%r); trying again in %.0f s", error, every_s)
        await asyncio.sleep(every_s)


async def sweep_once(nc: Connection, state: Callable[[], State], grace_s: float) -> list[str]:
    """Delete the weights no adapter names (written more than `grace_s` ago); the digests deleted."""
    stored = await stored_adapter_weights(nc)
    deleted = []
    for digest in orphan_weights(state(), stored, time.time(), grace_s):
        if any(adapter.digest == digest for adapter in state().adapters.values()):
            continue  # named meanwhile (an adapter added again with the same weights)
        await delete_adapter(nc, digest)
        deleted.append(digest)
    if deleted:
        log.info("master: deleted the weights of %d adapters no longer in State from the object store (%s)",
                 len(deleted), ", ".join(d[:12] for d in deleted))
    return deleted
