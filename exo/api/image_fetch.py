"""Images by http(s) URL, fetched by the API node behind a guard against server-side request
forgery: a client must not make the cluster read its own loopback, link-local or private
network (metadata services, admin ports) unless the operator allows it (EXO_IMAGE_URL_PRIVATE).

Every address a host resolves to is checked (one refused address refuses the URL: the
connection could go to any of them), and the connection goes to exactly the addresses checked:
aiohttp asks `_GuardedResolver`, which resolves, checks and hands back what it checked in one
call, so a DNS answer that changes between a check and a connect (DNS rebinding) has no second
chance. Redirects are followed by hand, each hop checked the same way; one timeout covers every
hop; the body is read in chunks and dropped at the byte cap; only image/* content is taken.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_REDIRECTS = 3
EVERYWHERE: tuple[IPNetwork, ...] = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
_REDIRECTS = {301, 302, 303, 307, 308}
_CHUNK_BYTES = 64 * 1024
_ALLOW_HINT = "set EXO_IMAGE_URL_PRIVATE=1 to allow such addresses"

# Named classes, checked in this order so an error says which rule refused an address; anything
# else that is not globally routable (documentation, benchmarking, IETF ranges) is refused after them.
_IPV4_CLASSES = [(name, ipaddress.IPv4Network(net)) for name, net in [
    ("unspecified", "0.0.0.0/8"), ("loopback", "127.0.0.0/8"), ("private", "10.0.0.0/8"), ("private", "172.16.0.0/12"),
    ("private", "192.168.0.0/16"), ("shared (carrier-grade NAT)", "100.64.0.0/10"), ("link-local", "169.254.0.0/16"),
    ("multicast", "224.0.0.0/4"), ("reserved", "240.0.0.0/4"),
]]
_IPV6_CLASSES = [(name, ipaddress.IPv6Network(net)) for name, net in [
    ("unspecified", "::/128"), ("loopback", "::1/128"), ("link-local", "fe80::/10"), ("unique-local (private)", "fc00::/7"),
    ("site-local (private)", "fec0::/10"), ("multicast", "ff00::/8"), ("local-use NAT64 (private)", "64:ff9b:1::/48"),
]]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def refused_class(address: IPAddress) -> str | None:
    """Why the guard refuses a connection to `address` (its class: 'loopback', 'private', ...),
    or None for a public address. An IPv6 form that carries an IPv4 address (mapped, compatible,
    6to4, NAT64) is judged by the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            inner_class = refused_class(inner)
            return f"{inner_class}, as IPv4 {inner}" if inner_class else None
    for name, network in _IPV4_CLASSES if address.version == 4 else _IPV6_CLASSES:
        if address in network:
            return name
    return None if address.is_global else "special-purpose (not globally routable)"


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):  # :: and ::1 are IPv6's own
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


class ImageFetchError(Exception):
    """Why an image URL gave no image, in words for the client."""


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int  # one image (EXO_MAX_IMAGE_BYTES)
    timeout_s: float  # the whole fetch, redirects included
    allowed: tuple[IPNetwork, ...] = ()  # let through though refused_class names them: EVERYWHERE turns the guard off


@dataclass
class ByteBudget:
    """Bytes the images of one request may still take, shared by its concurrent fetches."""

    left: int

    def take(self, count: int) -> bool:
        self.left -= count
        return self.left >= 0


def guard(host: str, address: IPAddress, allowed: tuple[IPNetwork, ...]) -> None:
    reason = refused_class(address)
    if reason is not None and not any(address in network for network in allowed):
        named = f"{address} is" if _ip_literal(host) is not None else f"{host} resolves to {address},"
        raise ImageFetchError(f"{named} a refused address ({reason}); {_ALLOW_HINT}")


class _GuardedResolver(AbstractResolver):
    """Resolves a host off the event loop, refuses it if any of its addresses is refused, and
    hands aiohttp exactly the addresses it checked. (aiohttp asks no resolver for an IP literal:
    `fetch_image` checks those itself.)"""

    def __init__(self, allowed: tuple[IPNetwork, ...]) -> None:
        self._allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise ImageFetchError(f"its host {host} does not resolve ({error.strerror})") from None
        results: list[ResolveResult] = []
        for family_found, _, proto, _, sockaddr in infos:
            address = ipaddress.ip_address(sockaddr[0])
            guard(host, address, self._allowed)
            results.append(ResolveResult(hostname=host, host=str(address), port=port, family=family_found, proto=proto,
                                         flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV))
        return results

    async def close(self) -> None:
        pass


async def fetch_image(url: str, limits: FetchLimits, budget: ByteBudget) -> bytes:
    """The bytes of the image at an http(s) `url`, or ImageFetchError saying why not."""
    connector = aiohttp.TCPConnector(resolver=_GuardedResolver(limits.allowed), use_dns_cache=False, force_close=True)
    try:
        async with asyncio.timeout(limits.timeout_s), aiohttp.ClientSession(
                connector=connector, auto_decompress=False, headers={"Accept": "image/*", "Accept-Encoding": "identity"}
        ) as session:
            return await _follow(session, URL(url), limits, budget)
    except TimeoutError:
        raise ImageFetchError(f"it took longer than {limits.timeout_s:g} s (EXO_IMAGE_URL_TIMEOUT_S)") from None
    except (aiohttp.ClientError, ValueError) as error:
        raise ImageFetchError(f"the request failed: {error}") from None


async def _follow(session: aiohttp.ClientSession, url: URL, limits: FetchLimits, budget: ByteBudget) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ImageFetchError(f"only http and https URLs with a host are fetched, not {str(url)[:100]!r}")
        literal = _ip_literal(url.raw_host)
        if literal is not None:  # a name is checked by _GuardedResolver, as it resolves it
            guard(url.raw_host, literal, limits.allowed)
        async with session.get(url, allow_redirects=False) as response:
            if response.status in _REDIRECTS and "Location" in response.headers:
                url = url.join(URL(response.headers["Location"]))
                continue
            return await _image_body(response, limits.max_bytes, budget)
    raise ImageFetchError(f"more than {MAX_REDIRECTS} redirects")


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def _image_body(response: aiohttp.ClientResponse, max_bytes: int, budget: ByteBudget) -> bytes:
    if not 200 <= response.status < 300:
        raise ImageFetchError(f"the server answered HTTP {response.status}")
    if not response.content_type.startswith("image/"):
        raise ImageFetchError(f"its content type is {response.content_type!r}, not an image/* type")
    if response.headers.get("Content-Encoding", "identity") != "identity":
        raise ImageFetchError(f"it came compressed ({response.headers['Content-Encoding']}); images are taken as they are")
    if (response.content_length or 0) > max_bytes:
        raise ImageFetchError(f"it is {response.content_length} bytes, over the limit of {max_bytes} (EXO_MAX_IMAGE_BYTES)")
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise ImageFetchError(f"it is larger than the limit of {max_bytes} bytes (EXO_MAX_IMAGE_BYTES)")
        if not budget.take(len(chunk)):
            raise ImageFetchError("the images of the request total more than EXO_MAX_REQUEST_IMAGE_BYTES")
    return bytes(body)
