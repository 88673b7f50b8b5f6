"""What every `exo <tool>` shares: --nats and --data-dir, connecting, output, exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Coroutine
from typing import Any

from exo import event_loop
from exo.bus.connection import Connection, connect, redact, split_urls
from exo.bus.errors import BusError
from exo.settings.declare import read, value_of
from exo.settings.services import NatsSecurity, NodeSettings
from exo.tools.export_format import ExportFormatError
from exo.tools.nats_target import DEFAULT_NATS_URL, NatsTarget, nats_target

EXIT_OK = 0
EXIT_FAILED = 1  # the tool ran and found a problem (e.g. a snapshot disagrees with the replay)
EXIT_ERROR = 2  # the tool could not do its job (bad arguments, no NATS, unreadable file)


class ToolError(Exception):
    """A reason a tool cannot do its job, said in one line."""


def add_nats_option(parser: argparse.ArgumentParser) -> None:
    """--nats and --data-dir, found as the node finds them."""
    parser.add_argument("--nats", default=None,
                        help=f"NATS URL(s), comma-separated (env EXO_NATS_URL; default: the embedded server of "
                             f"--data-dir's node, as its read-only operator, else {DEFAULT_NATS_URL})")
    parser.add_argument("--data-dir", default=value_of(NodeSettings, "data_dir"),
                        help="the node's data directory, where its embedded server's URL and credentials are "
                             "(env EXO_HOME; default ~/.exo)")


def target_of(args: argparse.Namespace) -> NatsTarget:
    return nats_target(args.nats, value_of(NodeSettings, "nats_url"), args.data_dir)


async def open_nats(args: argparse.Namespace, tool: str) -> Connection:
    """Connected where `args` say; else a ToolError naming the URL, where it came from and why."""
    target = target_of(args)
    urls = split_urls(target.urls)
    try:
        return await connect(urls, name=f"exo-{tool}", security=read(NatsSecurity))
    except BusError as error:
        reason = error.__cause__ or error
        shown = ", ".join(redact(url) for url in urls)
        raise ToolError(f"cannot connect to NATS at {shown} (from {target.source}): "
                        f"{reason or type(reason).__name__}") from error


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


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell, indented two spaces; `  (empty)` for no rows."""
    if not rows:
        return ["  (empty)"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
            for row in [header, *rows]]
