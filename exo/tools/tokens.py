"""`exo token`: join tokens, through a node's API: how a new machine joins a cluster with a secret.

    exo token create [--ttl 1h] [--uses 1] [--api-url URL]   print a token (shown once)
    exo token list [--json]                                   the tokens State keeps (no secrets)

On the new machine: `exo join <token>` (or EXO_JOIN_TOKEN=<token> exo). Each takes --url (a
node's API, default http://127.0.0.1:EXO_API_PORT) and --key (an admin key; env EXO_API_KEY).
docs/deploy.md, "Joining with a token".
"""

from __future__ import annotations

import argparse
import json
import time

from exo.tools.cli import table
from exo.tools.keys import KeysApi, admin_command, parsed_with_url, run_admin_tool

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """"90", "15m", "1h", "7d" in seconds."""
    unit = _UNITS.get(text[-1:], 0)
    try:
        return float(text[:-1]) * unit if unit else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90, 15m, 1h, 7d)") from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo token", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    create = admin_command(commands, "create", "make a join token (printed once)")
    create.add_argument("--ttl", type=duration_s, default=3600.0, help="how long it may be used (default 1h)")
    create.add_argument("--uses", type=int, default=1, help="how many nodes may join with it (default 1)")
    create.add_argument("--api-url", default="", help="where new nodes reach this API (default: the node's "
                                                      "cluster address, on the port of --url)")
    admin_command(commands, "list", "the tokens State keeps").add_argument("--json", action="store_true")
    return parsed_with_url(parser, argv)


def main(argv: list[str]) -> int:
    return run_admin_tool("token", parse_args(argv), {"create": _create, "list": _list})


def _create(api: KeysApi, args: argparse.Namespace) -> list[str]:
    body = {"ttl_s": args.ttl, "uses": args.uses, **({"api_url": args.api_url} if args.api_url else {})}
    made = api.call("POST", "/cluster/join_tokens", body)
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(made["expires_at"]))
    return [made["token"], "",
            f"join token {made['token_id']}: {made['uses']} use(s) until {until}, redeemed at {made['api_url']}",
            "on the new machine: exo join <token>   (or EXO_JOIN_TOKEN=<token> exo)"]


def _list(api: KeysApi, args: argparse.Namespace) -> list[str]:
    tokens = api.call("GET", "/cluster/join_tokens")["data"]
    if args.json:
        return [json.dumps(tokens, indent=2)]
    rows = [[t["token_id"], time.strftime("%Y-%m-%d %H:%M", time.gmtime(t["expires_at"])), str(t["uses_left"]),
             ", ".join(t["redeemed_by"]) or "-", t["created_by"]] for t in tokens]
    return table(["TOKEN", "EXPIRES (UTC)", "USES LEFT", "USED BY", "MADE BY"], rows) if rows else ["no join tokens"]
