"""`exo`: start one node. With no --nats URL it runs its own embedded nats-server."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exo import event_loop
from exo.bus.connection import SECURITY_ENV, split_urls
from exo.defaults import DEFAULT_API_PORT, DEFAULT_DATA_DIR, DEFAULT_NATS_PORT
from exo.tools import TOOLS

if TYPE_CHECKING:
    from exo.bus.server.cluster_node import DiscoverySettings
    from exo.node import NodeConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, but not the empty ones ("default: None" says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "", []):
            return action.help
        return super()._get_help_string(action)


class _Given(argparse.Action):
    """Stores the value and notes that it was asked for: only a default port is replaced when taken."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo", formatter_class=_HelpFormatter,
        usage="%(prog)s [OPTIONS]           run a node (OPTIONS below)\n       %(prog)s SUBCOMMAND ...     "
              "an operator tool (SUBCOMMAND below)",
        description="Run an exo node (master, worker and API), or an operator tool as `exo SUBCOMMAND ...`.",
        epilog="Every option can also come from the environment variable named in its help; a flag wins.\n"
               "Several nodes on one machine: docs/deploy.md.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    _add_tools(parser)
    parser.add_argument("--nats", default=os.environ.get("EXO_NATS_URL", ""),
                        help="NATS URL(s), comma-separated (env EXO_NATS_URL); default: start an embedded nats-server")
    parser.add_argument("--nats-port", type=int, action=_Given, default=int(os.environ.get("EXO_NATS_PORT", DEFAULT_NATS_PORT)),
                        help="client port of the embedded nats-server; 0: any free port (env EXO_NATS_PORT; "
                             "if the default is taken and none was asked for, a free one is chosen)")
    parser.add_argument("--data-dir", default=os.environ.get("EXO_HOME", DEFAULT_DATA_DIR),
                        help="where this node keeps its id, models, custom cards and the embedded NATS store (env EXO_HOME)")
    parser.add_argument("--host", default=os.environ.get("EXO_API_HOST"),
                        help="API listen address (env EXO_API_HOST; default: 0.0.0.0, or 127.0.0.1 when "
                             "--discovery-address is a loopback address)")
    parser.add_argument("--api-port", type=int, action=_Given, default=int(os.environ.get("EXO_API_PORT", DEFAULT_API_PORT)),
                        help="API and dashboard port (env EXO_API_PORT; if the default is taken and none was "
                             "asked for, the next free one is chosen)")
    parser.add_argument("--name", default=os.environ.get("EXO_NODE_NAME", ""),
                        help="what people call this node (env EXO_NODE_NAME; default: the hostname, plus "
                             ":API_PORT when that is not the default)")
    _add_service_arguments(parser)
    _add_cluster_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("EXO_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (env EXO_LOG_LEVEL)")
    return parser


def _add_service_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-master", action="store_true", help="do not run a master on this node")
    parser.add_argument("--no-worker", action="store_true", help="do not run models on this node")
    parser.add_argument("--no-api", action="store_true", help="do not serve the HTTP API")
    parser.add_argument("--snapshot-every", type=int, default=int(os.environ.get("EXO_SNAPSHOT_EVERY", "1000")),
                        help="the master snapshots State to KV every this many events...")
    parser.add_argument("--snapshot-interval", type=float, default=float(os.environ.get("EXO_SNAPSHOT_INTERVAL", "30")),
                        help="...or every this many seconds, whichever comes first")
    parser.add_argument("--events-max-age", type=float, default=_env_number("EXO_EVENTS_MAX_AGE_S"),
                        help="seconds the event log keeps events (applies when the stream is created)")
    parser.add_argument("--events-max-bytes", type=int, default=_env_number("EXO_EVENTS_MAX_BYTES", int),
                        help="bytes the event log keeps (applies when the stream is created)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="require this API key (repeatable; env EXO_API_KEYS, comma-separated)")
    parser.add_argument("--max-queue", type=int, default=_env_number("EXO_MAX_QUEUE", int),
                        help="open requests an instance admits before answering 429 (default 64)")
    parser.add_argument("--replicas", type=int, default=_env_number("EXO_REPLICAS", int),
                        help="replicas of every stream and bucket when they are created (3 on a 3-server NATS cluster)")
    parser.add_argument("--node-timeout", type=float, default=float(os.environ.get("EXO_NODE_TIMEOUT_S", "30")),
                        help="seconds without a heartbeat before the master times a node out (workers beat every "
                             "EXO_HEARTBEAT_S, default 5)")
    security = parser.add_argument_group("NATS security (or the environment variables named)")
    for key, env in SECURITY_ENV.items():
        flag = "--nats-" + key.replace("_", "-").replace("user-credentials", "creds")
        security.add_argument(flag, dest=f"security_{key}", help=f"env {env}")
    parser.add_argument("--offline", action="store_true", default=_env_flag("EXO_OFFLINE"),
                        help="use only complete models already in the model directories: no Hub, no peers (env EXO_OFFLINE)")
    parser.add_argument("--no-model-sharing", action="store_true",
                        help="do not serve models to other nodes nor fetch from them (env EXO_MODEL_SHARING=0)")


def _add_tools(parser: argparse.ArgumentParser) -> None:
    """The operator tools, listed in --help. `main` runs `exo TOOL ...` before any parsing, so each
    tool parses its own options; a tool named after node options is an error (they would be lost)."""
    tools = parser.add_subparsers(title="subcommands (each has its own --help; none: run a node)", dest="tool",
                                  metavar="SUBCOMMAND")
    for name, module in TOOLS.items():
        tool = tools.add_parser(name, help=_summary(module), add_help=False)
        tool.add_argument("tool_args", nargs=argparse.REMAINDER)


def _summary(module: str) -> str:
    """The first line of a tool module's docstring, read without importing the tool."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    line = (ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or "").strip().splitlines()[:1]
    text = line[0] if line else ""
    text = text.split(": ", 1)[1] if text.startswith("`") and ": " in text else text
    return text.removesuffix(".")


def package_version() -> str:
    try:
        return metadata.version("exo-jetstream")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        import exo

        return getattr(exo, "__version__", "unknown")


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tool:
        parser.error(f"put `{args.tool}` first: `exo {args.tool} ...` takes its own options (exo {args.tool} --help)")
    # Imported once parsed, not at the top: `exo <tool>`, --help and --version should not pay for them.
    from exo.banner import is_loopback
    from exo.node import NodeConfig

    if args.api_key:
        os.environ["EXO_API_KEYS"] = ",".join([*split_urls(os.environ.get("EXO_API_KEYS", "")), *args.api_key])
    for key, env in SECURITY_ENV.items():  # children (runners) inherit the environment
        if getattr(args, f"security_{key}"):
            os.environ[env] = getattr(args, f"security_{key}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request is noise here
        logging.getLogger(chatty).setLevel(logging.WARNING)
    discovery, trusted_lan = (None, False) if args.nats or args.no_discovery else _discovery_settings(args)
    return NodeConfig(
        data_dir=Path(args.data_dir).expanduser(), nats_urls=split_urls(args.nats), nats_port=args.nats_port,
        nats_port_auto=not (getattr(args, "nats_port_given", False) or "EXO_NATS_PORT" in os.environ),
        api_host=args.host or ("127.0.0.1" if is_loopback(args.discovery_address) else "0.0.0.0"),
        api_port=args.api_port,
        api_port_auto=not (getattr(args, "api_port_given", False) or "EXO_API_PORT" in os.environ),
        name=args.name, address=args.discovery_address,
        run_master=not args.no_master, run_worker=not args.no_worker, run_api=not args.no_api,
        snapshot_every=args.snapshot_every, snapshot_interval=args.snapshot_interval,
        events_max_age_s=args.events_max_age, events_max_bytes=args.events_max_bytes, replicas=args.replicas,
        max_queue=args.max_queue, node_timeout=args.node_timeout, offline=args.offline, model_sharing=False if args.no_model_sharing else None,
        discovery=discovery, trusted_lan=trusted_lan,
    )


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("zero-config cluster (mDNS discovery; off when --nats is given)")
    cluster.add_argument("--no-discovery", action="store_true", default=os.environ.get("EXO_DISCOVERY", "1") == "0",
                         help="run a standalone embedded server; do not look for other nodes (env EXO_DISCOVERY=0)")
    cluster.add_argument("--namespace", default=os.environ.get("EXO_NAMESPACE", "default"),
                         help="only nodes of the same namespace form a cluster (env EXO_NAMESPACE)")
    cluster.add_argument("--discovery-address", default=os.environ.get("EXO_DISCOVERY_ADDRESS", ""),
                         help="the address this node uses: mDNS, the cluster port, and the ring address of "
                              "multi-node instances (env EXO_DISCOVERY_ADDRESS; default: the LAN address; "
                              "EXO_ADVERTISE_ADDRESSES overrides the ring address)")
    cluster.add_argument("--cluster-port", type=int, default=int(os.environ.get("EXO_CLUSTER_PORT", "0")),
                         help="NATS cluster (route) port; 0: a free one, kept across restarts (env EXO_CLUSTER_PORT)")
    cluster.add_argument("--cluster-secret", default=os.environ.get("EXO_CLUSTER_SECRET", ""),
                         help="password of the cluster routes, the same on every node; kept after the first use "
                              "(env EXO_CLUSTER_SECRET; without one: trusted-LAN mode, named as a risk at start)")
    cluster.add_argument("--peer-remove-after", type=float, default=float(os.environ.get("EXO_PEER_REMOVE_AFTER_S", "3600")),
                         help="seconds a cluster server may be silent before it is treated as gone for good: its "
                              "stream replicas move to a spare server and it leaves the meta group (0: never; "
                              "env EXO_PEER_REMOVE_AFTER_S)")
    cluster.add_argument("--join-timeout", type=float, default=float(os.environ.get("EXO_JOIN_TIMEOUT_S", "60")),
                         help="seconds a first join through announced routes may take before the node decides again "
                              "without that cluster (a stale or spoofed announcement; env EXO_JOIN_TIMEOUT_S)")


def _discovery_settings(args: argparse.Namespace) -> tuple[DiscoverySettings, bool]:
    """The discovery settings, and whether they trust the LAN (no cluster secret)."""
    from exo.bus.server.cluster_node import DiscoverySettings
    from exo.bus.server.cluster_secret import lan_address, resolve_secret

    secret = resolve_secret(Path(args.data_dir).expanduser() / "nats", args.cluster_secret, args.namespace)
    return DiscoverySettings(address=args.discovery_address or lan_address(), secret=secret.value,
                             secret_id=secret.digest, namespace=args.namespace, cluster_port=args.cluster_port,
                             remove_after_s=args.peer_remove_after, join_timeout_s=args.join_timeout), secret.trusted_lan


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _env_number(name: str, kind: Callable[[str], float] = float) -> float | None:
    value = os.environ.get(name)
    return kind(value) if value else None


async def run(config: NodeConfig) -> int:
    from exo.banner import banner
    from exo.bus.errors import BusError
    from exo.node import Node, StartupError

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
    print(banner(node), flush=True)
    waiting = asyncio.create_task(node.wait())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    await node.stop()
    if waiting in done and not stopping.done():  # a service stopped by itself: a supervisor should restart us
        print("exo: a service stopped unexpectedly (see the log above); exiting", file=sys.stderr, flush=True)
        return 1
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:  # `exo replay ...`, `exo events ...`: the tool parses the rest
        tool = importlib.import_module(TOOLS[sys.argv[1]])
        sys.exit(tool.main(sys.argv[2:]))
    sys.exit(event_loop.run(run(parse_args())))


if __name__ == "__main__":
    main()
