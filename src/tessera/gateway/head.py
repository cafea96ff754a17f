"""Bounds on what a client may cost before its request is known.

Before a request's head is whole, nothing about it is authenticated: its
bytes and its connection are the only things a keyless client can spend.
Two bounds keep that spend small (``TimedHttpProtocol`` applies them):

- ``HeadLimits``: the head's sizes, counted as its bytes arrive, before the
  parser holds more than ``max_head_bytes`` of one head (twice that for a
  head pipelined behind a request); over a cap the client gets 414 (its
  URL) or 431 (a header, the head, the headers' count) and the connection
  is closed.
- ``OpeningConnections``: per client address (the socket's peer), the
  connections that have not yet sent a whole head. An address holding
  ``max_num_per_address`` of them that have waited ``STALE_AFTER_S`` or more
  has its next connection closed at once (429). A connection younger than
  that never counts, so a client's pool opening many connections at once,
  each sending its head at once, is never refused; a peer in
  ``trusted_proxies`` is a proxy speaking for many clients and is not bound.
  Its memory is one entry per open, still-opening connection: an address
  leaves the table with its last one.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tessera.config import (
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_NUM_HEADERS,
    DEFAULT_MAX_URL_BYTES,
)

# A client that means to send a request sends its head within a round trip of
# connecting; one still silent after this is slow on purpose or stuck.
STALE_AFTER_S = 1.0


@dataclass(frozen=True)
class HeadLimits:
    """Caps on one request head, each checked as its bytes arrive."""

    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # one header: name and value
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_num_headers: int = DEFAULT_MAX_NUM_HEADERS


@dataclass(frozen=True)
class HeadRefusal:
    """Why a head (or a connection) is refused: its answer's status, message and type."""

    status: int
    message: str
    kind: str

    @classmethod
    def url(cls, limits: HeadLimits) -> HeadRefusal:
        return cls(414, f"request URL over {limits.max_url_bytes} bytes", "uri_too_long")

    @classmethod
    def header(cls, limits: HeadLimits) -> HeadRefusal:
        message = f"a request header over {limits.max_header_bytes} bytes (name and value)"
        return cls(431, message, _TOO_LARGE)

    @classmethod
    def num_headers(cls, limits: HeadLimits) -> HeadRefusal:
        return cls(431, f"over {limits.max_num_headers} request headers", _TOO_LARGE)

    @classmethod
    def head(cls, limits: HeadLimits) -> HeadRefusal:
        return cls(431, f"request head over {limits.max_head_bytes} bytes", _TOO_LARGE)

    @classmethod
    def opening(cls, max_num_per_address: int) -> HeadRefusal:
        message = (
            f"{max_num_per_address} connections from this address have sent no request"
            " head yet: send on those, or close them"
        )
        return cls(429, message, "rate_limit_exceeded")


_TOO_LARGE = "request_header_fields_too_large"


class OpeningConnections:
    """Per client address, the open connections that have sent no whole head yet."""

    def __init__(
        self,
        max_num_per_address: int | None,
        trusted: Iterable[str] = (),
        *,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.max_num_per_address = max_num_per_address
        self.stale_after_s = stale_after_s
        self._trusted = _Addresses(trusted)
        # address -> connection id -> when it connected (oldest first)
        self._opening: dict[str, OrderedDict[int, float]] = {}

    def admit(self, address: str | None, connection: int, now: float) -> bool:
        """Count ``connection`` from ``address`` as opening, unless the address
        already holds its bound of stale ones (False: close it at once)."""
        # Invariant: only connections at least stale_after_s old are counted
        # against the bound; the walk stops at the first younger one, so it
        # costs at most max_num_per_address + 1 steps.
        if address is None or self.max_num_per_address is None or address in self._trusted:
            return True
        opening = self._opening.setdefault(address, OrderedDict())
        for num_stale, opened_at in enumerate(opening.values(), start=1):
            if now - opened_at < self.stale_after_s:
                break
            if num_stale >= self.max_num_per_address:
                return False
        opening[connection] = now
        return True

    def release(self, address: str | None, connection: int) -> None:
        """``connection`` sent a whole head or closed (either; more than once is fine)."""
        if address is None:
            return
        opening = self._opening.get(address)
        if opening is None:
            return
        opening.pop(connection, None)
        if not opening:
            del self._opening[address]

    def num_opening(self, address: str) -> int:
        return len(self._opening.get(address, ()))

    @property
    def num_addresses(self) -> int:
        return len(self._opening)


class _Addresses:
    """Addresses and networks as ``trusted_proxies`` names them (``*``: all)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.everyone = False
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            if entry.strip() == "*":
                self.everyone = True
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                continue  # a name or a socket path: never a TCP peer's address

    def __contains__(self, address: object) -> bool:
        if self.everyone:
            return True
        if not self.networks or not isinstance(address, str):
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)
