"""A runner: a subprocess that serves one instance's model with mlx-lm.

stdin carries requests from the worker and stdout carries reports back (JSON lines); text
goes straight to NATS on exo.tokens.<command_id>. Everything else the libraries print is
sent to stderr so it cannot corrupt the protocol.

This is the entry point (`python -m exo.runner`, started by exo/worker/runner_host.py); the
runner's work is in exo/runner/process.py.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import msgspec

from exo import event_loop
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import connect
from exo.runner.process import Runner
from exo.runner.protocol import RUNNER_START_ENV, RunnerStart
from exo.telemetry.setup import configure as configure_tracing
from exo.telemetry.setup import shutdown as shutdown_tracing


async def _main() -> None:
    reports = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library prints now land on stderr
    start = msgspec.json.decode(os.environ[RUNNER_START_ENV], type=RunnerStart)  # from the worker: runner_host.py
    configure_tracing(start.traces_endpoint, process="runner")
    nc = await connect(start.nats_urls, name="exo-runner", security=start.security)
    try:
        signer = ChunkSigner.from_file(start.node_id, Path(start.node_key_file)) if start.node_key_file else None
        await Runner(nc, reports, start.settings, signer).run()
    finally:
        await nc.drain()
        shutdown_tracing()  # its last spans out now: this process leaves by os._exit, past atexit


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        event_loop.run(_main())
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Never wait for the model thread at interpreter exit: a rank whose peers are gone blocks
        # in a collective forever (a runner orphaned so spun at 70% CPU until killed by hand).
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)
