"""The wall between sandboxes and the cluster's own services: which addresses it holds.

In cluster mode the controller publishes the cluster's infrastructure in the metadata
database as the setting ``cluster_addresses`` (every Ray node, the edges' and replicas'
hosts, the database, the MooseFS master, and what ``dsec cluster up --protect`` named),
and each edge adds its own node's addresses as ``cluster_addresses:edge:NAME`` (a node
has several, and the edge's host is infrastructure too). Every edge reads them all every
few seconds (:class:`ClusterWall`), resolves the names among them itself, and the
network manager puts the result in its nft table's ``cluster`` sets, which drop sandbox
traffic ahead of every allow rule, and in what raw rules and the egress gate refuse.

What was last read is kept in a file on the node, so an edge restarted while the
database is down walls off the same addresses; a name that stops resolving keeps the
addresses it had (a DNS outage must not open the wall).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy.engine import make_url

from dsec.node.edge.network.rules import POOL

log = logging.getLogger("dsec.network")

SETTING = "cluster_addresses"  # the controller's; each edge's is SETTING:edge:NAME
RESOLVE_S = 10.0  # names among the entries are resolved again this often

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def edge_key(name: str) -> str:
    return f"{SETTING}:edge:{name}"


def entry(text: str) -> str:
    """``text`` (an address, a CIDR or a host name) as an entry; ValueError says why not."""
    text = text.strip().strip("[]")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_network(text, strict=False))
    name = text.rstrip(".").lower()
    if not name or len(name) > 253 or not all(
            part and len(part) <= 63 and part.replace("-", "").replace("_", "").isalnum()
            for part in name.split(".")):
        raise ValueError(f"{text!r} is not an address, a network (CIDR) or a host name")
    return name


def url_host(url: str) -> str | None:
    """The host a URL (http://..., postgresql://...) names, or None (a unix socket)."""
    try:
        u = make_url(url)
        host = u.host or u.query.get("host")
    except Exception:  # not a database URL: a plain one
        from urllib.parse import urlsplit
        host = urlsplit(url).hostname
    if isinstance(host, tuple):
        host = host[0] if host else None
    if not host or str(host).startswith("/"):
        return None
    return str(host)


def moosefs_master(path: str) -> str | None:
    """The MooseFS master's host that ``path`` is mounted from, if it is on MooseFS
    (mfsmount's source is ``mfs#HOST:PORT``, ``#`` escaped as ``\\043`` in mountinfo, and its
    file system type ``fuse`` or ``fuse.mfs``)."""
    best: tuple[int, str] | None = None
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if " - " not in line or len(fields) < 5:
                continue
            mount = fields[4]
            fstype, source = line.split(" - ", 1)[1].split()[:2]
            source = source.replace("\\043", "#")
            if "mfs" not in fstype and not source.startswith("mfs#"):
                continue
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and (best is None or len(mount) > best[0]):
                best = (len(mount), source)
    if best is None:
        return None
    source = best[1].removeprefix("mfs#")
    host = source.rsplit(":", 1)[0] if ":" in source else source
    return host.strip("[]") or None


def own_addresses() -> list[str]:
    """Every address of this node (its sandboxes' link ends excepted: they are not the
    node's services, and every sandbox of the node is walled off already)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = {str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr()}
    out = []
    for a in found:
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(a.split("%")[0])
            if not (ip.version == 4 and ip in POOL):
                out.append(str(ip))
    return sorted(out)


def networks(entries: Iterable[str], resolved: dict[str, list[str]]) -> list[Net]:
    """The entries as networks (names by what they ``resolved`` to), collapsed per family."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for e in entries:
        for text in resolved.get(e, []) if _is_name(e) else [e]:
            with contextlib.suppress(ValueError):
                n = ipaddress.ip_network(text.split("%")[0], strict=False)
                if n.network_address.is_unspecified:
                    continue  # "any address" (a daemon bound to all) names no host
                if isinstance(n, ipaddress.IPv4Network):
                    v4.append(n)
                else:
                    v6.append(n)
    return [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]


def _is_name(e: str) -> bool:
    try:
        ipaddress.ip_network(e, strict=False)
        return False
    except ValueError:
        return True


class ClusterWall:
    """The cluster's addresses as this edge knows them: read from the registry, resolved,
    kept in ``path``. Blocking methods: the network manager calls them off its loop."""

    def __init__(self, path: str, registry: Any = None, name: str = "") -> None:
        self.path, self.registry, self.name = path, registry, name
        self.entries: list[str] = []
        self.resolved: dict[str, list[str]] = {}
        self.nets: list[Net] = []
        self._resolved_at: dict[str, float] = {}
        self._published: list[str] | None = None
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path) as f:
                saved = json.load(f)
            self.entries = [str(e) for e in saved.get("entries", [])]
            self.resolved = {str(k): [str(a) for a in v] for k, v in saved.get("resolved", {}).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            return
        self.nets = networks(self.entries, self.resolved)

    def _save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"entries": self.entries, "resolved": self.resolved, "at": time.time()}, f)
        os.replace(tmp, self.path)

    def refresh(self) -> bool:
        """Publish this node's addresses, read everyone's, resolve the names among them.
        True when the walled networks changed. The database unreachable: what was read
        last stands (the caller logs the error)."""
        if self.registry is None:
            return False
        own = own_addresses()
        if own != self._published:
            self.registry.put_setting(edge_key(self.name), json.dumps(own))
            self._published = own
        entries: set[str] = set()
        for value in self.registry.settings_like(SETTING).values():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for e in json.loads(value):
                    with contextlib.suppress(ValueError):
                        entries.add(entry(str(e)))
        now = time.monotonic()
        for name in (e for e in entries if _is_name(e)):
            if now - self._resolved_at.get(name, -RESOLVE_S) < RESOLVE_S:
                continue
            self._resolved_at[name] = now
            try:
                infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError as e:  # keeps what it had: a DNS outage must not open the wall
                log.warning("cluster address %s does not resolve (%s); kept as %s", name, e,
                            self.resolved.get(name, "nothing yet"))
                continue
            self.resolved[name] = sorted({str(i[4][0]) for i in infos})
        nets = networks(sorted(entries), self.resolved)
        changed = sorted(entries) != self.entries or nets != self.nets
        self.entries, self.nets = sorted(entries), nets
        if changed:
            self._save()
        return changed
