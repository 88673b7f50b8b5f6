"""`exo node`: list the cluster's nodes, or remove one, through a node's API.

    exo node list [--json]                the nodes in State, and those removed
    exo node remove NODE [--reason TEXT]  revoke a node (its id, name or short id): its instances
                                          end (their generations move to other nodes), it leaves
                                          State for good and stops itself

Each takes --url (a node's API, default http://127.0.0.1:EXO_API_PORT; ask another node's API
than the one removed) and --key (an admin key; env EXO_API_KEY). What removal does and does not
stop yet: docs/deploy.md, "Removing a node".
"""

from __future__ import annotations

import argparse
import json
import urllib.parse

from exo.tools.cli import table
from exo.tools.keys import KeysApi, admin_command, parsed_with_url, run_admin_tool


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    admin_command(commands, "list", "the nodes in State, and those removed").add_argument("--json", action="store_true")
    remove = admin_command(commands, "remove", "revoke a node: it leaves the cluster for good")
    remove.add_argument("node", help="its id, name or short id")
    remove.add_argument("--reason", default="", help="why, for the log, State and the node's own last line")
    return parsed_with_url(parser, argv)


def main(argv: list[str]) -> int:
    return run_admin_tool("node", parse_args(argv), {"remove": _remove, "list": _list})


def _remove(api: KeysApi, args: argparse.Namespace) -> list[str]:
    body = {"reason": args.reason} if args.reason else None
    answer = api.call("POST", f"/nodes/{urllib.parse.quote(args.node, safe='')}/remove", body)
    return [f"removed node {answer['name']} ({answer['node_id']}) by {answer['removed_by']}"
            f"{': ' + answer['reason'] if answer['reason'] else ''}"]


def _list(api: KeysApi, args: argparse.Namespace) -> list[str]:
    state = api.call("GET", "/state")
    nodes, revoked = state.get("nodes", {}), state.get("revoked_nodes", {})  # .get: an older node has none
    if args.json:
        return [json.dumps({"nodes": nodes, "revoked_nodes": revoked})]
    rows = [[node_id, n.get("name") or n.get("hostname") or "-", "in the cluster"] for node_id, n in sorted(nodes.items())]
    rows += [[node_id, "-", f"removed by {r.get('removed_by') or 'an admin'}{': ' + r['reason'] if r.get('reason') else ''}"]
             for node_id, r in revoked.items()]
    return table(["id", "name", "status"], rows)
