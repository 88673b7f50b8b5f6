"""`exo keys`: create, list and delete API keys and read their usage, through a node's API.

    exo keys create --name NAME [--models PATTERN ...] [--admin] [--priority batch]
                    [--requests-per-minute N] [--tokens-per-minute N] [--concurrent-requests N]
                    [--tokens-per-day N] [--tokens-per-month N] [--cache-scope NAME]
        prints the new key's secret, this once (the node keeps only its hash)
    exo keys list [--json]
    exo keys delete KEY_ID
    exo keys usage [KEY_ID] [--json]     requests, tokens and audio seconds by key, UTC day and model

Each takes --url (the node's API, default http://127.0.0.1:EXO_API_PORT) and --key (an admin
key: one of the node's EXO_API_KEYS or a key created with --admin; env EXO_API_KEY). A node with
no keys at all needs none. Limits are 0 for none (docs/deploy.md, "One cluster, many users").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from exo.core.keys import KeyLimits
from exo.settings.declare import value_of
from exo.settings.services import NodeSettings, ToolSettings
from exo.tools.cli import EXIT_ERROR, EXIT_OK, ToolError, table

_TIMEOUT_S = 60  # POST /keys waits for the master's decision (up to its own command timeout)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    create = admin_command(commands, "create", "add a key; its secret is printed once")
    create.add_argument("--name", required=True, help="what people call the key")
    create.add_argument("--models", nargs="+", default=None, metavar="PATTERN",
                        help="glob patterns of the model ids it may use (default: all)")
    create.add_argument("--admin", action="store_true", help="it may manage keys, models and instances")
    create.add_argument("--priority", choices=["interactive", "batch"], default=None)
    create.add_argument("--cache-scope", default=None, metavar="NAME",
                        help="keys with the same scope share prompt-cache hits")
    for limit in KeyLimits.__struct_fields__:  # the API's own limit names, as flags
        create.add_argument(f"--{limit.replace('_', '-')}", dest=limit, type=int, default=None, metavar="N",
                            help="0: no limit")
    create.add_argument("--json", action="store_true", help="print the API's answer (secret and key) as JSON")
    admin_command(commands, "list", "every key, without secrets").add_argument("--json", action="store_true")
    admin_command(commands, "delete", "delete a key: it fails on every node at once").add_argument("key_id")
    usage = admin_command(commands, "usage", "requests, tokens and audio seconds by key, UTC day and model")
    usage.add_argument("key_id", nargs="?", default="", help="one key's (default: every key's)")
    usage.add_argument("--json", action="store_true")
    return parsed_with_url(parser, argv)


def parsed_with_url(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments of an admin tool (`exo keys`, `exo node`, `exo token`), its --url checked."""
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url {args.url!r} is not an http:// or https:// URL")
    return args


def run_admin_tool(name: str, args: argparse.Namespace,
                   commands: Mapping[str, Callable[[KeysApi, argparse.Namespace], list[str]]]) -> int:
    """Run the subcommand `args.command` against the node's API; its lines, or the error, printed."""
    api = KeysApi(args.url.rstrip("/"), args.key)
    try:
        lines = commands[args.command](api, args)
    except ToolError as error:
        print(f"exo {name}: {error}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    print("\n".join(lines), flush=True)
    return EXIT_OK


def admin_command(commands: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand that talks to a node's API with an admin key (`exo keys`, `exo node`)."""
    command: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=summary)
    command.add_argument("--url", default=f"http://127.0.0.1:{value_of(NodeSettings, 'api_port')}",
                         help="the node's API (default http://127.0.0.1:EXO_API_PORT, 52415)")
    command.add_argument("--key", default=value_of(ToolSettings, "api_key"),
                         help="an admin API key (env EXO_API_KEY)")
    return command


def main(argv: list[str]) -> int:
    return run_admin_tool("keys", parse_args(argv), {"create": _create, "list": _list, "delete": _delete,
                                                     "usage": _usage})


class KeysApi:
    """The node's key routes (exo/api/cluster/keys.py), with errors that name the URL."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self._key = key

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode())
        request.add_header("Content-Type", "application/json")
        if self._key:
            request.add_header("Authorization", f"Bearer {self._key}")
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise ToolError(self._refusal(method, path, error.code, _message_of(error.read()))) from None
        except (urllib.error.URLError, OSError) as error:  # refused, unknown host, timed out
            reason = getattr(error, "reason", error)
            raise ToolError(f"cannot reach the API at {self.url}: {reason}; is a node running there? "
                            "(--url, or EXO_API_PORT)") from None

    def _refusal(self, method: str, path: str, status: int, message: str) -> str:
        if status == 401 and not self._key:
            return f"{self.url} needs an admin key: pass --key or set EXO_API_KEY ({message})"
        if status == 401:
            return f"{self.url} does not accept this key ({message})"
        if status == 403:
            return f"{self.url}: this key is not an admin key ({message})"
        return f"{method} {self.url}{path}: {status} {message}"


def _message_of(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200] or "no message"


def _create(api: KeysApi, args: argparse.Namespace) -> list[str]:
    limits = {name: value for name in KeyLimits.__struct_fields__ if (value := getattr(args, name)) is not None}
    asked = {"name": args.name, "admin": args.admin or None, "models": args.models, "priority": args.priority,
             "cache_scope": args.cache_scope, "limits": limits or None}
    answer = api.call("POST", "/keys", {field: value for field, value in asked.items() if value is not None})
    if args.json:
        return [json.dumps(answer)]
    key = answer["key"]
    lines = [f"created key {key['key_id']} ({key['name']}{', admin' if key['admin'] else ''})",
             f"secret (shown this once; the node keeps only its hash): {answer['secret']}"]
    if not args.key and not key["admin"]:
        lines.append("note: a node with keys admits only keys; keep an admin key (EXO_API_KEYS, or create one "
                     "with --admin) to manage them")
    return lines


def _list(api: KeysApi, args: argparse.Namespace) -> list[str]:
    keys = api.call("GET", "/keys")["data"]
    if args.json:
        return [json.dumps(keys)]
    rows = [[k["key_id"], k["name"] or "-", "yes" if k["admin"] else "no", ", ".join(k["models"]) or "all",
             _limits_text(k["limits"]), k["priority"], _utc(k["created_at"])] for k in keys]
    return table(["id", "name", "admin", "models", "limits", "priority", "created (UTC)"], rows)


def _limits_text(limits: dict[str, int]) -> str:
    return ", ".join(f"{name}={value:,}" for name, value in limits.items() if value) or "none"


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(seconds)) if seconds else "-"


def _delete(api: KeysApi, args: argparse.Namespace) -> list[str]:
    api.call("DELETE", f"/keys/{urllib.parse.quote(args.key_id, safe='')}")
    return [f"deleted key {args.key_id}"]


def _usage(api: KeysApi, args: argparse.Namespace) -> list[str]:
    query = f"?{urllib.parse.urlencode({'key_id': args.key_id})}" if args.key_id else ""
    rows = api.call("GET", f"/usage{query}")["data"]
    if args.json:
        return [json.dumps(rows)]
    return table(["key", "day", "model", "requests", "prompt tokens", "completion tokens", "cached tokens",
                  "audio seconds"],
                 [[r["key_id"], r["day"], r["model"], f"{r['requests']:,}", f"{r['prompt_tokens']:,}",
                   f"{r['completion_tokens']:,}", f"{r['cached_tokens']:,}",
                   f"{r.get('audio_seconds', 0.0):,.1f}"] for r in rows])  # .get: an older node has none
