"""`exo`: start one node. With no --nats URL it runs its own embedded nats-server."""

from __future__ import annotations

import argparse
import importlib
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from exo import event_loop
from exo.bus.connection import split_urls
from exo.bus.errors import BusError
from exo.node import Node, NodeConfig, StartupError
from exo.tools import TOOLS


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    parser = argparse.ArgumentParser(prog="exo", description="Run an exo node (master, worker and API).")
    parser.add_argument("--nats", default=os.environ.get("EXO_NATS_URL", ""),
                        help="NATS URL(s), comma-separated (env EXO_NATS_URL); default: start an embedded nats-server")
    parser.add_argument("--nats-port", type=int, default=int(os.environ.get("EXO_NATS_PORT", "4222")),
                        help="client port of the embedded nats-server (0: any free port)")
    parser.add_argument("--data-dir", default=os.environ.get("EXO_HOME", str(Path.home() / ".exo")),
                        help="where this node keeps its id, models, custom cards and the embedded NATS store")
    parser.add_argument("--host", default=os.environ.get("EXO_API_HOST", "0.0.0.0"), help="API listen address")
    parser.add_argument("--api-port", type=int, default=int(os.environ.get("EXO_API_PORT", "52415")))
    parser.add_argument("--no-master", action="store_true", help="do not run a master on this node")
    parser.add_argument("--no-worker", action="store_true", help="do not run models on this node")
    parser.add_argument("--no-api", action="store_true", help="do not serve the HTTP API")
    parser.add_argument("--log-level", default=os.environ.get("EXO_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return NodeConfig(
        data_dir=Path(args.data_dir).expanduser(), nats_urls=split_urls(args.nats), nats_port=args.nats_port,
        api_host=args.host, api_port=args.api_port,
        run_master=not args.no_master, run_worker=not args.no_worker, run_api=not args.no_api,
    )


async def run(config: NodeConfig) -> int:
    node = Node(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # the second Ctrl-C: leave now
            node.kill()
            os._exit(130)
        print("exo: stopping (Ctrl-C again to exit at once)", file=sys.stderr, flush=True)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await node.start()
    except (StartupError, BusError) as error:
        print(f"exo: {error}", file=sys.stderr, flush=True)
        await node.stop()
        return 1
    print(f"exo: node ready, API at {node.api_url or '(off)'}, NATS at {','.join(node.nats_urls)}", flush=True)
    waiting = asyncio.create_task(node.wait())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    await node.stop()
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:  # `exo replay ...`, `exo events ...`, ...
        tool = importlib.import_module(TOOLS[sys.argv[1]])
        sys.exit(tool.main(sys.argv[2:]))
    sys.exit(event_loop.run(run(parse_args())))


if __name__ == "__main__":
    main()
