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
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from exo import event_loop
from exo.bus.connection import split_urls
from exo.core.groups import parse_groups
from exo.log_format import configure_logging
from exo.settings.declare import SettingError, is_given, read
from exo.settings.flags import add_setting_flags, environment_only, given_flags
from exo.settings.services import (
    SERVICE_SETTINGS,
    ApiSettings,
    BusSettings,
    ClusterSettings,
    MasterSettings,
    ModelSettings,
    NatsSecurity,
    NodeSettings,
    RunnerSettings,
    WorkerSettings,
)
from exo.tools import TOOLS

if TYPE_CHECKING:
    from exo.bus.server.cluster_node import DiscoverySettings
    from exo.node import NodeConfig


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's lines; each flag's help says its variable and default itself."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo", formatter_class=_HelpFormatter,
        usage="%(prog)s [OPTIONS]           run a node (OPTIONS below)\n       %(prog)s SUBCOMMAND ...     "
              "an operator tool (SUBCOMMAND below)",
        description="Run an exo node (master, worker and API), or an operator tool as `exo SUBCOMMAND ...`.",
        epilog="Every option can also come from the environment variable named in its help; a flag wins.\n"
               f"{environment_only()}\nAll of them: docs/operations.md. Several nodes on one machine: docs/deploy.md.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    _add_tools(parser)
    add_setting_flags(parser)
    return parser


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


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> NodeConfig:
    """The node's configuration: every setting read once, from the flags and then `environ`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tool:
        parser.error(f"put `{args.tool}` first: `exo {args.tool} ...` takes its own options (exo {args.tool} --help)")
    try:
        settings = {cls: read(cls, environ, given_flags(args, cls)) for cls in SERVICE_SETTINGS}
    except SettingError as error:
        parser.error(str(error))
    join_problem = _join_problem(cast(NodeSettings, settings[NodeSettings]), cast(ClusterSettings, settings[ClusterSettings]))
    if join_problem:
        parser.error(join_problem)
    try:  # read here, so a bad map stops the node before it starts anything
        parse_groups(cast(MasterSettings, settings[MasterSettings]).groups)
    except ValueError as error:
        parser.error(f"EXO_MASTER_GROUPS (--master-groups): {error}")
    node = cast(NodeSettings, settings[NodeSettings])
    from exo.node import default_name  # here, as in node_config: --help and the tools do not pay for it
    configure_logging(node.log_level, node.log_format, node.name or default_name(node.api_port))
    from exo.telemetry.setup import configure, traces_endpoint  # here too: --help and the tools skip opentelemetry
    configure(traces_endpoint(node.otlp_endpoint, environ), process="node", node=node.name or default_name(node.api_port))
    for chatty in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request is noise here
        logging.getLogger(chatty).setLevel(logging.WARNING)

    def auto(field: str) -> bool:  # a default port, not asked for: replaced by a free one if taken
        return not is_given(NodeSettings, field, environ, given_flags(args, NodeSettings))
    from exo.join_token import JoinRefused

    try:
        return node_config(settings, nats_port_auto=auto("nats_port"), api_port_auto=auto("api_port"))
    except JoinRefused as refused:
        parser.exit(1, f"exo: cannot join with this token: {refused}\n")


def _join_problem(node: NodeSettings, cluster: ClusterSettings) -> str:
    """Why --join cannot be used as given ("" if it can)."""
    if cluster.join_token and node.nats_url:
        return ("--join-token (EXO_JOIN_TOKEN) joins a cluster of exo's embedded servers; --nats (EXO_NATS_URL) "
                "makes this node a client of another server: give one of them")
    if not cluster.join:
        return ""
    if node.nats_url:
        return ("--join (EXO_JOIN) makes this node a member of a cluster through its own embedded server; "
                "--nats (EXO_NATS_URL) makes it a client of another server: give one of them")
    host, _, port = cluster.join.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--join (EXO_JOIN): {cluster.join!r} is not HOST:PORT (a member's cluster port, from its start banner)"
    return ""


def node_config(settings: Mapping[type[Any], Any], nats_port_auto: bool = False, api_port_auto: bool = False) -> NodeConfig:
    # Imported here, not at the top: `exo <tool>`, --help and --version should not pay for them.
    from exo.banner import is_loopback
    from exo.node import NodeConfig

    node: NodeSettings = settings[NodeSettings]
    cluster: ClusterSettings = settings[ClusterSettings]
    data_dir = Path(node.data_dir).expanduser()
    clustered = not node.nats_url and (cluster.discovery or bool(cluster.join) or bool(cluster.join_token))
    discovery, trusted_lan = _discovery(cluster, data_dir, node.name) if clustered else (None, False)
    return NodeConfig(
        data_dir=data_dir, nats_urls=split_urls(node.nats_url), nats_port=node.nats_port, nats_port_auto=nats_port_auto,
        api_host=node.api_host or ("127.0.0.1" if is_loopback(cluster.discovery_address) else "0.0.0.0"),
        api_port=node.api_port, api_port_auto=api_port_auto, name=node.name, address=cluster.discovery_address,
        run_master=node.run_master, run_worker=node.run_worker, run_api=node.run_api,
        discovery=discovery, trusted_lan=trusted_lan, security=settings[NatsSecurity], bus=settings[BusSettings],
        models=settings[ModelSettings], master=settings[MasterSettings], worker=settings[WorkerSettings],
        runner=settings[RunnerSettings], api=settings[ApiSettings],
    )


def _discovery(cluster: ClusterSettings, data_dir: Path, name: str) -> tuple[DiscoverySettings, bool]:
    """The discovery settings, and whether they trust the LAN (no cluster secret)."""
    from exo.bus.server.cluster_node import DiscoverySettings
    from exo.bus.server.cluster_secret import SECRET_FILE, lan_address, resolve_secret

    given, join = cluster.cluster_secret, cluster.join
    if cluster.join_token and not given and not (data_dir / "nats" / SECRET_FILE).exists():
        from exo.join_token import redeem  # the first start with a token: what it admits to

        given, redeemed_join = redeem(cluster.join_token, name, cluster.join_timeout_s)
        join = join or redeemed_join
    secret = resolve_secret(data_dir / "nats", given, cluster.namespace)
    return DiscoverySettings(address=cluster.discovery_address or lan_address(), secret=secret.value,
                             secret_id=secret.digest, namespace=cluster.namespace, cluster_port=cluster.cluster_port,
                             remove_after_s=cluster.peer_remove_after_s, join=join, mdns=cluster.discovery,
                             join_timeout_s=cluster.join_timeout_s), secret.trusted_lan


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
    if node.removed:  # an admin removed it: it must not come back as this node (it would refuse to start)
        print(f"exo: {node.removed}; exiting", file=sys.stderr, flush=True)
        return 1
    if waiting in done and not stopping.done():  # a service stopped by itself: a supervisor should restart us
        print("exo: a service stopped unexpectedly (see the log above); exiting", file=sys.stderr, flush=True)
        return 1
    return 0


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "join" and not sys.argv[2].startswith("-"):  # `exo join TOKEN [OPTIONS]`
        sys.argv[1:3] = ["--join-token", sys.argv[2]]
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:  # `exo replay ...`, `exo events ...`: the tool parses the rest
        tool = importlib.import_module(TOOLS[sys.argv[1]])
        sys.exit(tool.main(sys.argv[2:]))
    sys.exit(event_loop.run(run(parse_args())))


if __name__ == "__main__":
    main()
