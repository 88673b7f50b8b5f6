"""`exo nats-context`: a `nats` CLI context for this machine's node, as its read-only operator.

    exo nats-context [--name exo] [--select] [--data-dir DIR] [--nats URL]

The embedded server admits only the users in `<data dir>/nats/credentials.json`. This writes a
context (the CLI's saved connection settings) with the running node's URL and the `operator`
user's password, so that `nats --context exo stream ls` works; `--select` makes it the CLI's
default, so that plain `nats stream ls` does. The operator reads everything and changes nothing
(exo/bus/server/permissions.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

from exo.bus.errors import BusError
from exo.bus.server.embedded import CREDENTIALS_FILE, load_credentials
from exo.bus.server.permissions import OPERATOR_USER
from exo.settings.declare import value_of
from exo.settings.services import NodeSettings
from exo.tools.cli import EXIT_ERROR, EXIT_OK, ToolError
from exo.tools.nats_target import running_server_url

# Every field `nats context save` writes (natscli v0.5.0), so the file reads like one it made.
_EMPTY_CONTEXT: dict[str, object] = {
    "description": "", "url": "", "socks_proxy": "", "token": "", "user": "", "password": "", "creds": "",
    "nkey": "", "cert": "", "key": "", "ca": "", "nsc": "", "jetstream_domain": "", "jetstream_api_prefix": "",
    "jetstream_event_prefix": "", "inbox_prefix": "", "user_jwt": "", "user_seed": "", "color_scheme": "",
    "tls_first": False, "windows_cert_store": "", "windows_cert_match_by": "", "windows_cert_match": "",
    "windows_ca_certs_match": None,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo nats-context", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="exo", help="the context's name (default exo)")
    parser.add_argument("--select", action="store_true", help="also make it the `nats` CLI's selected context")
    parser.add_argument("--data-dir", default=value_of(NodeSettings, "data_dir"),
                        help="the node's data directory (env EXO_HOME; default ~/.exo)")
    parser.add_argument("--nats", default="",
                        help="the server URL(s) to save, comma-separated (default: where the node of --data-dir "
                             "listens); a URL with user:password@ saves those credentials instead of the operator's")
    parser.add_argument("--config-dir", default="",
                        help="the `nats` CLI's configuration directory (default $XDG_CONFIG_HOME/nats or "
                             "~/.config/nats)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        _check_name(args.name)
        urls, user, password = _connection(args.nats, Path(args.data_dir).expanduser() / "nats")
        config_dir = Path(args.config_dir).expanduser() if args.config_dir else _default_config_dir()
        path = write_context(config_dir, args.name, {
            "description": f"exo node at {urls} as {user}", "url": urls, "user": user, "password": password})
        if args.select:
            select_context(config_dir, args.name)
    except (ToolError, BusError, OSError) as error:
        print(f"exo nats-context: {error}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    _report(args.name, path, urls, user, args.select)
    return EXIT_OK


def _check_name(name: str) -> None:
    # The CLI's own rule (jsm.go natscontext.ValidateName): the name is a file name.
    if not name or ".." in name or "/" in name or "\\" in name:
        raise ToolError(f"invalid context name {name!r}: it must be non-empty, without '..', '/' or '\\'")


def _connection(nats: str, store: Path) -> tuple[str, str, str]:
    """(URLs without credentials, user, password) for the context."""
    if nats:
        return _from_urls(nats, store)
    url = running_server_url(store)
    if url is None:
        raise ToolError(f"no exo node is running with data dir {store.parent} (no live server in {store / 'ports'}); "
                        "start one with `uv run exo`, or pass its --data-dir (or EXO_HOME), or --nats URL")
    return (url, OPERATOR_USER, _operator_password(store))


def _from_urls(nats: str, store: Path) -> tuple[str, str, str]:
    bare, users = [], set()
    for url in (u.strip() for u in nats.split(",") if u.strip()):
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if not parts.hostname:
            raise ToolError(f"--nats {url!r} is not a URL like nats://127.0.0.1:4222")
        bare.append(f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}")
        if parts.username is not None:
            users.add((unquote(parts.username), unquote(parts.password or "")))
    if len(users) > 1:
        raise ToolError("--nats URLs name different users; a context holds one user and password")
    if users:
        user, password = users.pop()
        return ",".join(bare), user, password
    return ",".join(bare), OPERATOR_USER, _operator_password(store)


def _operator_password(store: Path) -> str:
    if not (store / CREDENTIALS_FILE).exists():
        raise ToolError(f"{store / CREDENTIALS_FILE} not found: no node has started with data dir {store.parent}; "
                        "pass the node's --data-dir (or EXO_HOME), or credentials in --nats nats://user:pw@host:port")
    return load_credentials(store).operator_password


def _default_config_dir() -> Path:
    # Where natscli looks (jsm.go natscontext): $XDG_CONFIG_HOME/nats, else ~/.config/nats.
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "nats"


def write_context(config_dir: Path, name: str, fields: dict[str, object]) -> Path:
    """Write `<config_dir>/context/<name>.json` (0600: it holds a password), replacing any."""
    path = config_dir / "context" / f"{name}.json"
    _write_private(path, json.dumps({**_EMPTY_CONTEXT, **fields}, indent=2) + "\n")
    return path


def select_context(config_dir: Path, name: str) -> None:
    """Make `name` the CLI's selected context, keeping the one before as its previous (`nats ctx select -`)."""
    selected = config_dir / "context.txt"
    previous = selected.read_text().strip() if selected.exists() else ""
    if previous and previous != name:
        _write_private(config_dir / "previous-context.txt", previous)
    _write_private(selected, name)


def _write_private(path: Path, text: str) -> None:
    """Atomically, readable by this user only, in a directory only they can list (as the CLI does)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(text)
    partial.replace(path)


def _report(name: str, path: Path, urls: str, user: str, selected: bool) -> None:
    role = " (read-only)" if user == OPERATOR_USER else ""
    print(f"wrote nats context {name!r} to {path}: {urls} as user {user}{role}")
    if selected:
        print("selected it: plain `nats ...` commands use it")
    print("next: nats stream ls" if selected else f"next: nats --context {name} stream ls")
    if shutil.which("nats") is None:
        print("the `nats` CLI is not on PATH: go install github.com/nats-io/natscli/nats@v0.5.0 "
              "(it lands in $(go env GOPATH)/bin)")
