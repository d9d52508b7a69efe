"""Which `Host` a server answers to, and which requests come from another site's page.

Torch-free: `mgr` (daemon/auth.py) and the engine (engine/serving/access.py) apply the same rules.

A `Host` the server does not serve is how DNS rebinding shows: a page on the attacker's name,
resolved to this machine, reaches the port but still names the attacker's host. A request that
changes something and carries a foreign `Origin` (or that a browser marks cross-site) is how a
page on another site drives a server the user can reach.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable, Mapping

import psutil

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP address (an IPv4-mapped IPv6 one as its IPv4, any zone dropped)."""
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback_address(address: str) -> bool:
    """Whether a peer address is this machine's loopback (IPv4, IPv6, IPv4-mapped IPv6)."""
    ip = _address(address)
    return ip is not None and ip.is_loopback


def split_host(header: str) -> tuple[str, int | None]:
    """`Host` or an origin's authority as (lower-case name without brackets, port or None)."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif header.count(":") == 1:
        name, port = header.split(":")
    else:
        name, port = header, ""
    try:
        return name.rstrip("."), int(port) if port else None
    except ValueError:
        return "", None


def is_loopback_host(name: str) -> bool:
    return name in LOOPBACK_NAMES or is_loopback_address(name)


class ServedHosts:
    """The names and addresses a server answers to; anything else in `Host` is refused.

    Always: loopback names and addresses, the names given with --allow-host, and the address the
    connection arrived on (the socket's own, so an address that came up after start, a new
    Wi-Fi, a VPN or a DHCP lease, is served at once). Bound to a wildcard address, also every
    address of every interface (re-read every few seconds) and the machine's host names; bound
    to one address, that address.
    """

    REFRESH_S = 10.0

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        self.bind_host = bind_host
        self.extra = {split_host(name)[0] for name in extra}
        self._cached: frozenset[str] = frozenset()
        self._cached_at = -1e9
        self._lock = threading.Lock()

    @property
    def wildcard(self) -> bool:
        return self.bind_host in WILDCARD_HOSTS

    def names(self) -> frozenset[str]:
        with self._lock:
            if time.monotonic() - self._cached_at > self.REFRESH_S:
                self._cached = frozenset(self._collect())
                self._cached_at = time.monotonic()
            return self._cached

    def _collect(self) -> set[str]:
        names = set(LOOPBACK_NAMES) | {"127.0.0.1", "::1"} | self.extra
        if not self.wildcard:
            names.add(self.bind_host.strip("[]").lower())
            return names
        for addresses in psutil.net_if_addrs().values():
            for address in addresses:
                if address.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(address.address.split("%", 1)[0].lower())
        hostname = socket.gethostname().lower()
        names |= {hostname, hostname.split(".")[0], hostname.split(".")[0] + ".local"}
        return names

    def serves(self, host_header: str | None, local_address: str | None = None) -> bool:
        """Whether `Host` names this server; `local_address`: the address of the socket the
        request arrived on (ASGI's `scope["server"]`)."""
        if not host_header:
            return False
        name, _port = split_host(host_header)
        if not name:
            return False
        if is_loopback_address(name) or name in self.names():
            return True
        named = _address(name)
        return named is not None and local_address is not None and named == _address(local_address)


def is_foreign(headers: Mapping[str, str], host: str) -> bool:
    """Whether a request comes from another site's page: its `Origin` is not `host` (the
    request's own `Host`), or the browser says it is cross-site (or same-site: another port or
    name of the same site is still another origin). `headers`: lower-case names."""
    if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return True
    origin = headers.get("origin")
    if origin is None:
        return False
    scheme, _, authority = origin.partition("://")
    if scheme not in ("http", "https") or not authority:
        return True  # "null" (sandboxed frames, file: pages) and other oddities
    return split_host(authority) != split_host(host)
