"""A join token as a string, and a new node's first start with one (`exo join TOKEN`, EXO_JOIN_TOKEN).

The token's string is exo/api/cluster/token_string.py's; the rest is pure (exo/core/join_tokens.py).
The new node presents the
token at the member API the token names and keeps what comes back, the cluster's secret (in its
store, as EXO_CLUSTER_SECRET is kept) and a member's cluster address (joined like --join). A node
whose store holds a secret already (a restart) uses that and never presents the token again.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request

from exo.api.cluster.token_string import BadToken, decode_token

log = logging.getLogger(__name__)

RETRY_S = 1.0
_MAX_ANSWER_BYTES = 64 * 1024
class JoinRefused(Exception):
    """The token cannot be used: the text says why and what to do."""


def redeem(token: str, node_name: str, timeout_s: float) -> tuple[str, str]:
    """(the cluster secret, a member's cluster address); JoinRefused if the cluster says no. A member
    that does not answer (starting, restarting) is asked again until `timeout_s`."""
    try:
        parts = decode_token(token)
    except BadToken as bad:
        raise JoinRefused(str(bad)) from None
    url = f"{parts.api}/cluster/join"
    body = json.dumps({"token": token.strip(), "node_name": node_name or socket.gethostname()}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return _access(response.read(_MAX_ANSWER_BYTES), url)
        except urllib.error.HTTPError as error:
            raise JoinRefused(f"{url} refused the join token: {_message(error.read(_MAX_ANSWER_BYTES))}") from None
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() >= deadline:
                raise JoinRefused(f"no member answers at {url} within {timeout_s:g} s "
                                  f"({getattr(error, 'reason', error)}); is the node that made the token running?") from None
            log.info("join token: %s does not answer yet (%s); asking again", url, getattr(error, "reason", error))
        time.sleep(RETRY_S)


def _access(data: bytes, url: str) -> tuple[str, str]:
    try:
        answer = json.loads(data)
        secret, join = answer["cluster_secret"], answer["join"]
    except (ValueError, KeyError, TypeError):
        raise JoinRefused(f"{url} did not answer as an exo member does ({data[:80]!r})") from None
    host, _, port = join.rpartition(":") if isinstance(join, str) else ("", "", "")
    if not isinstance(secret, str) or not 0 < len(secret) <= 1024 or not host or not port.isdigit():
        raise JoinRefused(f"{url} answered without a usable secret and cluster address")
    return secret, join


def _message(data: bytes) -> str:
    try:
        error = json.loads(data)["error"]
        return str(error["message"] if isinstance(error, dict) else error)[:500]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode(errors="replace")
