"""Raw egress rules (``ip[/len]:port[-port]/proto`` and the cluster admin's
``host:port[-port]/proto``): parsed, and refused when they would open what no tenant may
reach. The kernel drops the same destinations ahead of any allow (dsec.node.edge.network.nft),
so a rule that slipped past this check would still not reach them; the check is what
gives the caller a 400 naming the field instead of a rule that silently does nothing.

Never reachable by an ``ip:port`` rule, for anyone: this host (any of its addresses; the
``host:`` form is the only way there), every sandbox of every edge on the host (the whole
pool), loopback, link-local (metadata services), multicast, broadcast, reserved and
"this network" space, and ranges wider than a /8. In a cluster, neither is any address of
the cluster's own services (dsec.node.edge.network.wall: Ray nodes, the database, edges,
replicas, storage), on any node.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from dsec.shared.errors import InvalidRequest

POOL = ipaddress.IPv4Network("10.211.0.0/16")  # carved into /19 blocks, one per edge on a host
NEVER = (
    ipaddress.IPv4Network("0.0.0.0/8"),       # "this network"
    ipaddress.IPv4Network("127.0.0.0/8"),     # loopback
    ipaddress.IPv4Network("169.254.0.0/16"),  # link-local: cloud metadata services
    ipaddress.IPv4Network("224.0.0.0/4"),     # multicast
    ipaddress.IPv4Network("240.0.0.0/4"),     # reserved, and the broadcast address
    POOL,                                     # every edge's sandboxes on this host
)
MIN_PREFIX = 8  # a rule names a service's range, not the internet
HOST = "host"  # the key form that reaches this host itself: the cluster admin's alone


@dataclass(frozen=True)
class RawRule:
    """One raw rule; ``net`` None for ``host:`` (any of this host's own addresses)."""

    net: ipaddress.IPv4Network | None
    ports: tuple[int, int]
    proto: str

    @property
    def port_text(self) -> str:
        lo, hi = self.ports
        return str(lo) if lo == hi else f"{lo}-{hi}"

    @property
    def net_text(self) -> str:
        if self.net is None:
            return HOST
        return self.net.with_prefixlen if self.net.prefixlen < 32 else str(self.net.network_address)

    def element(self, src: str) -> str:
        """Its nft set element for sandbox address ``src`` (raw_allow, or host_allow)."""
        if self.net is None:
            return f"{src} . {self.proto} . {self.port_text}"
        return f"{src} . {self.net_text} . {self.proto} . {self.port_text}"

    def overlaps(self, other: RawRule) -> bool:
        if self.proto != other.proto or (self.net is None) != (other.net is None):
            return False
        if self.net is not None and other.net is not None and not self.net.overlaps(other.net):
            return False
        return self.ports[0] <= other.ports[1] and other.ports[0] <= self.ports[1]

    def __str__(self) -> str:
        return f"{self.net_text}:{self.port_text}/{self.proto}"


def is_host_rule(key: str) -> bool:
    return key.startswith(HOST + ":")


def parse(key: str, forbidden: list[ipaddress.IPv4Network],
          walled: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> RawRule:
    """``key`` as a rule; ``forbidden``: this node's own addresses and subnets, on top of
    NEVER; ``walled``: the cluster's own services' addresses. InvalidRequest (field
    network_rules) names what is wrong."""
    addr, _, rest = key.partition(":")
    ports, _, proto = rest.partition("/")
    lo, _, hi = ports.partition("-")
    try:
        p1, p2 = int(lo), int(hi or lo)
    except ValueError:
        raise InvalidRequest(f"network rule {key!r}: ports must be numbers", field="network_rules") from None
    if not (1 <= p1 <= p2 <= 65535):
        raise InvalidRequest(f"network rule {key!r}: ports must be 1-65535, low to high", field="network_rules")
    if proto not in ("tcp", "udp"):
        raise InvalidRequest(f"network rule {key!r}: the protocol is tcp or udp", field="network_rules")
    if addr == HOST:
        return RawRule(None, (p1, p2), proto)
    try:
        net = ipaddress.IPv4Network(addr, strict=False)
    except ValueError as e:
        raise InvalidRequest(f"network rule {key!r}: {e}", field="network_rules") from None
    if net.prefixlen < MIN_PREFIX:
        raise InvalidRequest(f"network rule {key!r}: {net} is too broad (at most a /{MIN_PREFIX})",
                             field="network_rules")
    for wall in walled:
        if wall.version == 4 and net.overlaps(wall):  # (a v4 network "overlaps" v6 ones by their bits)
            raise InvalidRequest(
                f"network rule {key!r}: {net} reaches {wall}, an address of the cluster's own services "
                f"(Ray, the database, the edges and apiservers, storage), which no sandbox may reach",
                field="network_rules")
    for bad in (*NEVER, *forbidden):
        if net.overlaps(bad):
            raise InvalidRequest(
                f"network rule {key!r}: {net} reaches {bad}, which no sandbox may reach "
                f"(this host, sandboxes, loopback, link-local, multicast or reserved space)",
                field="network_rules")
    return RawRule(net, (p1, p2), proto)


def check_disjoint(rules: list[RawRule]) -> None:
    """Two rules covering the same destination, protocol and port would be one set element
    written twice: refused here by name rather than by the kernel."""
    for i, a in enumerate(rules):
        for b in rules[i + 1:]:
            if a.overlaps(b):
                raise InvalidRequest(f"network rules {str(a)!r} and {str(b)!r} overlap: give one of them",
                                     field="network_rules")


def forbidden_destination(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                          local: list[ipaddress.IPv4Network],
                          walled: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> bool:
    """An address no allowed name may lead the egress gate to."""
    if ip.version != 4:
        return True
    return any(ip in n for n in (*NEVER, *local)) or any(n.version == 4 and ip in n for n in walled)
