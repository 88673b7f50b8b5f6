"""Model download speed, one run, side by side: a node fetching a ~200 MB generated model
(sharded safetensors plus index, config and tokenizer) from the local imitation of the Hub over
HTTP, then a second node fetching it from the first (a process of its own) through NATS with
the Hub stopped.

Both use exo's download coordinator as a worker does (verification, manifest, events included),
against an embedded nats-server and tests/support/fake_hub.py on this machine.

    uv run python -m bench.download [--layers 3] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from exo import event_loop
from exo.bus.connection import Connection, connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.state_view import StateView
from exo.core.events import Event
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import ModelCard
from exo.models.dirs import DownloadSettings, ModelDirs
from exo.worker.downloads import DownloadCoordinator
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model
from tests.support.tiny_model import Dims

REPO = ModelId("exo-bench/sharded-llama")


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir() if p.is_file() and p.name[0] != "."}


def coordinator(nc: Connection, node_id: NodeId, root: Path, endpoint: str, card: ModelCard,
                state: Callable[[], State]) -> DownloadCoordinator:
    log = EventLog(nc)
    settings = DownloadSettings(dirs=ModelDirs(writable=(root,)), hub_endpoint=endpoint)

    async def publish(event: Event) -> None:
        await log.append(event, uuid.uuid4().hex)

    return DownloadCoordinator(nc=nc, node_id=node_id, settings=settings, publish=publish, state=state,
                               card_of={card.model_id: card}.get)


async def timed_download(url: str, view: StateView, card: ModelCard, root: Path, endpoint: str,
                         node_id: NodeId) -> tuple[float, str, Path]:
    """(seconds, source, model directory). Each node has a connection of its own."""
    nc = await connect([url], name=f"bench-{root.name}")
    node = coordinator(nc, node_id, root, endpoint, card, lambda: view.state)
    await node.start()
    started = time.perf_counter()
    path = await node.ensure(card)
    elapsed = time.perf_counter() - started
    while (record := view.state.download_of(node_id, card.model_id)) is None or record.status != "completed":
        await asyncio.sleep(0.05)  # peers find a model through State: wait for the event to fold in
    await node.stop()
    await nc.close()
    return elapsed, record.source, path


async def serve(url: str, node_id: NodeId, root: Path) -> None:
    """The first node, in a process of its own (as on another machine), serving its copy."""
    nc = await connect([url], name="bench-serve")
    node = coordinator(nc, node_id, root, "http://127.0.0.1:9", ModelCard(model_id=REPO), State)
    await node.start()
    print("serving", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await node.stop()
    await nc.close()


async def main(dims: Dims) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model = make_sharded_model(root / "repo", dims)
        size = sum(p.stat().st_size for p in model.iterdir())
        print(f"model: {size / 1e6:.0f} MB in {len(list(model.glob('*.safetensors')))} safetensors files "
              f"(generated in {time.perf_counter() - started:.1f} s)", flush=True)
        card = ModelCard(model_id=REPO, n_layers=dims.layers)
        hub = FakeHub({REPO: model})
        endpoint = hub.start()
        hub._snapshot(model)  # noqa: SLF001 - hash the repo once now, not inside the timing
        server = EmbeddedNats(root / "nats", port=0)
        url = await server.start()
        nc = await connect([url], name="bench-download")
        first_id, peer = NodeId(uuid.uuid4().hex), None
        try:
            await provision(nc)
            view = StateView(nc)
            await view.start()
            hub_s, hub_source, first = await timed_download(url, view, card, root / "a", endpoint, first_id)
            hub.stop()
            peer = subprocess.Popen([sys.executable, "-m", "bench.download", "--serve", url, first_id, str(root / "a")],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert peer.stdout is not None and peer.stdout.readline().strip() == "serving"
            peer_s, peer_source, second = await timed_download(url, view, card, root / "b", endpoint, NodeId(uuid.uuid4().hex))
            assert digests(first) == digests(second) == digests(model)
            await view.stop()
        finally:
            if peer is not None:
                peer.communicate(timeout=30)
            await nc.close()
            server.stop()
            hub.stop()
    print(f"\n{'source':<28} {'seconds':>8} {'MB/s':>8}")
    print(f"{'Hub imitation (HTTP)':<28} {hub_s:>8.2f} {size / 1e6 / hub_s:>8.0f}   ({hub_source})")
    print(f"{'peer node (NATS)':<28} {peer_s:>8.2f} {size / 1e6 / peer_s:>8.0f}   ({peer_source[:13]}...)")
    print(f"ratio peer / Hub: {hub_s / peer_s:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--serve", nargs=3, metavar=("NATS_URL", "NODE_ID", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        sys.exit(event_loop.run(serve(args.serve[0], NodeId(args.serve[1]), Path(args.serve[2]))))
    event_loop.run(main(Dims(hidden=args.hidden, intermediate=4 * args.hidden, layers=args.layers, heads=16, kv_heads=8)))
