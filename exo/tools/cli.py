"""What every `exo <tool>` shares: the --nats option, connecting, output, exit codes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from exo import event_loop
from exo.bus.connection import Connection, connect, split_urls
from exo.bus.errors import BusError
from exo.bus.server.embedded import CREDENTIALS_FILE, load_credentials, with_user
from exo.bus.server.permissions import OPERATOR_USER
from exo.settings.declare import read, value_of
from exo.settings.services import NatsSecurity, NodeSettings
from exo.tools.export_format import ExportFormatError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
EXIT_OK = 0
EXIT_FAILED = 1  # the tool ran and found a problem (e.g. a snapshot disagrees with the replay)
EXIT_ERROR = 2  # the tool could not do its job (bad arguments, no NATS, unreadable file)


class ToolError(Exception):
    """A reason a tool cannot do its job, said in one line."""


def add_nats_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=value_of(NodeSettings, "nats_url"),
                        help=f"NATS URL(s), comma-separated (env EXO_NATS_URL; default {DEFAULT_NATS_URL}, as the "
                             "read-only operator of this machine's embedded server: EXO_HOME or ~/.exo)")


def local_operator_url() -> str:
    """The local node's embedded server (EXO_HOME or ~/.exo), where its ports file says it listens,
    with its read-only operator's password if there is one."""
    store = Path(value_of(NodeSettings, "data_dir")).expanduser() / "nats"
    url = running_server_url(store) or DEFAULT_NATS_URL
    if not (store / CREDENTIALS_FILE).exists():
        return url
    return with_user(url, OPERATOR_USER, load_credentials(store).operator_password)


def running_server_url(store: Path) -> str | None:
    """The client URL a live embedded server of this store wrote to its ports file (a node started
    with `--nats-port 0` or another port is not on 4222), preferring loopback; None if none runs."""
    for ports_file in sorted((store / "ports").glob("*.ports")):
        try:
            pid = int(ports_file.stem.rsplit("_", 1)[1])
            os.kill(pid, 0)  # a file a killed server left behind names a port nobody listens on
            urls = json.loads(ports_file.read_text())["nats"]
        except (ValueError, IndexError, KeyError, TypeError, OSError):
            continue
        loopback = [u for u in urls if isinstance(u, str) and "://127.0.0.1:" in u]
        if loopback or urls:
            return str((loopback or urls)[0])
    return None


async def open_nats(urls: str, tool: str) -> Connection:
    return await connect(split_urls(urls or local_operator_url()), name=f"exo-{tool}", security=read(NatsSecurity))


def run_tool(tool: str, main: Coroutine[Any, Any, int]) -> int:
    """Run a tool's coroutine; its errors become one line on stderr and an exit code."""
    try:
        return event_loop.run(main)
    except (BusError, ToolError, ExportFormatError, OSError) as error:
        if isinstance(error, BrokenPipeError):  # `exo replay ... | head`: the reader left
            _silence_stdout()
            return EXIT_OK
        print(f"exo {tool}: {error}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _silence_stdout() -> None:
    # Python flushes stdout at exit; a closed pipe would make that fail loudly.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class Output:
    """Buffered writes to stdout: a million lines must not cost a million system calls."""

    def __init__(self) -> None:
        self._out = sys.stdout.buffer

    def line(self, text: str) -> None:
        self._out.write(text.encode() + b"\n")

    def raw(self, data: bytes) -> None:
        self._out.write(data)

    def flush(self) -> None:
        self._out.flush()
