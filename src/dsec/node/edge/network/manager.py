"""Per-edge network policy: addresses, links, rules, and the resolver and gate that serve
them. The edge calls ``attach`` / ``update`` / ``detach`` per sandbox and ``readopt`` for
the ones it finds again after a restart; everything else here is internal.

Design: docs/network.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.node.agent.aether import ProcRootFiles
from dsec.node.edge.network import wiring
from dsec.node.edge.network.catalog import ServiceCatalog, host_allowed
from dsec.node.edge.network.dns import Resolver
from dsec.node.edge.network.gate import Gate
from dsec.node.edge.network.nft import NftTable
from dsec.node.edge.network.rules import POOL, RawRule, check_disjoint, forbidden_destination, parse
from dsec.node.edge.network.wall import ClusterWall, Net
from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import NetworkInfo

log = logging.getLogger("dsec.network")

BLOCK_PREFIX = 19
POLL_S = 2.0  # kernel denials collected, and the host's addresses re-read, this often


@dataclass
class Link:
    sandbox_id: str
    index: int
    ip: str
    host_ip: str
    ifname: str
    rules: dict[str, bool] = field(default_factory=dict)
    raw: list[RawRule] = field(default_factory=list)
    patterns: list[str] = field(default_factory=list)


class NetworkManager:
    def __init__(self, edge_root: str, run_dir: str, services: list[str] | None = None,
                 subnet: str | None = None,
                 on_event: Callable[[str, str, str], None] = lambda *_: None) -> None:
        self.edge_root, self.run_dir = edge_root, run_dir
        self.extra_services = services or []
        self.requested_subnet = subnet
        self.on_event = on_event
        self.links: dict[str, Link] = {}
        self.by_ip: dict[str, Link] = {}
        self.catalog = ServiceCatalog({})
        self.subnet = POOL
        self.table: NftTable | None = None
        self.resolver = Resolver(self._allowed, self._denied)
        self.gate = Gate(self._allowed, self._denied, self._forbidden)
        self._host_addrs: list[ipaddress.IPv4Network] = []
        # the cluster's own services (dsec.node.edge.network.wall): empty unless use_cluster is called
        self.wall = ClusterWall(os.path.join(edge_root, "cluster_addresses.json"))
        self._wall_task: asyncio.Task[None] | None = None
        self._walled: list[Net] = []  # what the table's cluster sets hold now
        self._lock_fd: int | None = None
        self._poll: asyncio.Task[None] | None = None
        self._seen: dict[tuple[str, str, str, int], int] = {}
        self.started = False

    # ---- edge lifecycle ----------------------------------------------------
    def use_cluster(self, registry: object, edge_name: str) -> None:
        """In a cluster (``registry``: its metadata database's): wall sandboxes off from
        the cluster's own services, re-read every POLL_S, and publish this node's addresses."""
        self.wall.registry, self.wall.name = registry, edge_name

    async def start(self) -> None:
        """Catalog, subnet, resolver, gate and the nft table. Cheap enough to do at every
        edge start; a node without nftables still runs sandboxes without network."""
        self.catalog = await asyncio.to_thread(ServiceCatalog.from_node, self.extra_services)
        self.subnet = await asyncio.to_thread(self._claim_subnet)
        await self._refresh_host_addrs()
        await self.resolver.start()
        await self.gate.start()
        tag = hashlib.sha1(self.edge_root.encode()).hexdigest()[:8]
        self.table = NftTable(f"dsec_{tag}", self.subnet, self.resolver.port, self.gate.port)
        for stale in await asyncio.to_thread(self.table.remove_stale):
            log.warning("removed nft table %s: a dead edge's, for this edge's subnet %s", stale, self.subnet)
        await self.table.install()
        if self.wall.nets:  # the last list read, before any sandbox is wired: the database may be down
            await self.table.apply(self.table.set_cluster(self.wall.nets))
            self._walled = list(self.wall.nets)
        wiring.enable_forwarding()
        self._poll = asyncio.create_task(self._poll_denied())
        if self.wall.registry is not None:
            self._wall_task = asyncio.create_task(self._poll_wall())
        self.started = True

    async def close(self, keep: bool) -> None:
        """``keep``: sandboxes stay running (an edge restart): their links and the table stay."""
        for task in (self._poll, self._wall_task):
            if task:
                task.cancel()
        self.resolver.close()
        self.gate.close()
        if not keep and self.table is not None:
            with contextlib.suppress(Exception):
                await self.table.remove()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _claim_subnet(self) -> ipaddress.IPv4Network:
        """This edge's block: the one it had before (its sandboxes keep their addresses
        across a restart), else the first free one no other edge on the host holds."""
        saved_path = os.path.join(self.edge_root, "network.json")
        saved = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(saved_path) as f:
                saved = json.load(f)["subnet"]
        candidates = [self.requested_subnet] if self.requested_subnet else \
            ([saved] if saved else []) + [str(b) for b in POOL.subnets(new_prefix=BLOCK_PREFIX)]
        routes = _host_networks()
        lock_dir = "/run/dsec/net"
        os.makedirs(lock_dir, exist_ok=True)
        for cand in candidates:
            net = ipaddress.IPv4Network(cand)
            if any(net.overlaps(r) for r in routes):
                continue
            fd = os.open(os.path.join(lock_dir, str(net).replace("/", "_")), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if self.requested_subnet:
                    raise RuntimeError(f"sandbox subnet {net} is in use by another edge on this host") from None
                continue
            self._lock_fd = fd
            with open(saved_path, "w") as f:
                json.dump({"subnet": str(net)}, f)
            return net
        raise RuntimeError("no free sandbox subnet on this host")

    # ---- per sandbox ---------------------------------------------------------
    async def _refresh_host_addrs(self) -> None:
        """This host's own addresses (as /32s): no raw rule and no name may lead to them.
        Read at start and every POLL_S (pyroute2 off the loop)."""
        addrs = await asyncio.to_thread(_host_addresses)
        self._host_addrs = sorted(ipaddress.IPv4Network(a) for a in addrs if ":" not in a)

    def _split(self, rules: dict[str, bool], walled: bool = True) -> tuple[list[str], list[RawRule]]:
        """``walled``: rules reaching the cluster's own services are refused (False for
        rules a sandbox already had: the kernel drops that traffic whatever they say)."""
        services, raw = [], []
        for key, on in rules.items():
            if not on:
                continue
            if ":" in key:
                raw.append(parse(key, [self.subnet, *self._host_addrs], self.wall.nets if walled else ()))
            elif key in self.catalog:
                services.append(key)
            else:
                known = ", ".join(sorted(self.catalog.services)) or "none"
                raise InvalidRequest(f"unknown network service {key!r} (this node knows: {known})",
                                     field="network_rules")
        check_disjoint(raw)
        return services, raw

    def _info(self, link: Link) -> NetworkInfo:
        return NetworkInfo(address=link.ip, gateway=link.host_ip, rules=dict(link.rules), hosts=list(link.patterns))

    def validate(self, rules: dict[str, bool]) -> None:
        if not self.started:
            raise InvalidRequest("this node has no sandbox networking (nftables unavailable at edge start)",
                                 field="network_rules")
        self._split(rules)

    async def wire(self, sandbox_id: str, init_pid: int, rules: dict[str, bool]) -> NetworkInfo:
        """Give a container (its init: ``init_pid``) its link under ``rules``; its resolver
        is the edge's, and it trusts the CAs the node's package managers trust (an egress
        proxy's among them)."""
        info = await self.attach(sandbox_id, init_pid, rules)
        files = ProcRootFiles(init_pid)
        await files.write_file("/etc/resolv.conf", f"nameserver {info.gateway}\noptions timeout:2\n".encode())
        if self.catalog.ca_bundle:
            await files.write_file("/etc/ssl/certs/ca-certificates.crt", self.catalog.ca_bundle)
        return info

    async def attach(self, sandbox_id: str, init_pid: int, rules: dict[str, bool]) -> NetworkInfo:
        self.validate(rules)
        used = {link.index for link in self.links.values()}
        index = next(i for i in range(1, self.subnet.num_addresses // 2) if i not in used)
        link = Link(sandbox_id, index, str(self.subnet[2 * index + 1]), str(self.subnet[2 * index]),
                    wiring.ifname_for(str(self.subnet[2 * index + 1])))
        self.links[sandbox_id] = link
        self.by_ip[link.ip] = link
        try:
            await wiring.wire(init_pid, link.ifname, link.host_ip, link.ip)
            await self._apply(link, {k: v for k, v in rules.items() if v}, new_link=True)
        except BaseException:
            await self.detach(sandbox_id)
            raise
        return self._info(link)

    async def update(self, sandbox_id: str, changes: dict[str, bool]) -> NetworkInfo:
        link = self.links[sandbox_id]
        merged = {**link.rules, **changes}
        self.validate(merged)
        await self._apply(link, {k: v for k, v in merged.items() if v}, new_link=False)
        return self._info(link)

    async def _apply(self, link: Link, rules: dict[str, bool], new_link: bool, walled: bool = True) -> None:
        assert self.table is not None
        services, raw = self._split(rules, walled)
        await self.table.apply(self.table.set_sandbox(link.ifname, link.ip, link.raw, raw, new_link))
        link.rules, link.raw, link.patterns = rules, raw, self.catalog.patterns(services)

    async def readopt(self, sandbox_id: str, info: NetworkInfo) -> None:
        """A sandbox found again after an edge restart: the table was rewritten, so its
        elements go back in (the link itself lived on in the kernel)."""
        link = Link(sandbox_id, (int(ipaddress.IPv4Address(info.address)) - int(self.subnet[0])) // 2,
                    info.address, info.gateway, wiring.ifname_for(info.address))
        if ipaddress.IPv4Address(info.address) not in self.subnet:
            log.warning("%s has address %s outside this edge's subnet %s", sandbox_id, info.address, self.subnet)
        self.links[sandbox_id] = link
        self.by_ip[link.ip] = link
        try:  # a rule to an address walled off since stays: the kernel drops its traffic
            await self._apply(link, info.rules, new_link=True, walled=False)
        except InvalidRequest as e:  # a service the operator has since removed: deny it
            log.warning("%s: %s; its rules are reset to deny-all", sandbox_id, e)
            await self._apply(link, {}, new_link=True)

    async def detach(self, sandbox_id: str) -> None:
        link = self.links.pop(sandbox_id, None)
        if link is None:
            return
        self.by_ip.pop(link.ip, None)
        if self.table is not None:
            with contextlib.suppress(Exception):
                await self.table.apply(self.table.drop_sandbox(link.ifname, link.ip, link.raw))
        await wiring.unwire(link.ifname)

    def has(self, sandbox_id: str) -> bool:
        return sandbox_id in self.links

    # ---- resolver and gate callbacks -------------------------------------------
    def _allowed(self, source: str, host: str) -> bool | None:
        link = self.by_ip.get(source)
        if link is None:
            return None
        return host_allowed(host, link.patterns)

    def _denied(self, source: str, what: str) -> None:
        link = self.by_ip.get(source)
        if link is not None:
            self.on_event(link.sandbox_id, "egress_denied", what)

    def _forbidden(self, address: str) -> bool:
        return forbidden_destination(ipaddress.ip_address(address), [self.subnet, *self._host_addrs], self.wall.nets)

    async def _poll_wall(self) -> None:
        """The cluster's addresses into the table's ``cluster`` sets: at once, then every POLL_S.
        A database that does not answer leaves the last list in force."""
        assert self.table is not None
        failing = False
        while True:
            try:
                await asyncio.to_thread(self.wall.refresh)
                nets = list(self.wall.nets)
                if nets != self._walled:  # (compared with what the table holds: a failed apply is retried)
                    await self.table.apply(self.table.set_cluster(nets))
                    self._walled = nets
                    log.info("sandboxes walled off from the cluster's %d networks", len(nets))
                failing = False
            except Exception as e:
                if not failing:  # said once per outage, not every POLL_S
                    log.warning("cluster addresses not refreshed (the last %d stand): %s", len(self.wall.nets), e)
                failing = True
            await asyncio.sleep(POLL_S)

    async def _poll_denied(self) -> None:
        """Flows the kernel rejected, reported once per new packet count (bounded by the set's size)."""
        assert self.table is not None
        while True:
            await asyncio.sleep(POLL_S)
            with contextlib.suppress(Exception):
                await self._refresh_host_addrs()
            if not self.links:
                continue
            with contextlib.suppress(Exception):
                for src, dst, proto, port, packets in await self.table.denied():
                    key = (src, dst, proto, port)
                    if packets > self._seen.get(key, 0):
                        self._denied(src, f"{proto} {dst}:{port} ({packets - self._seen.get(key, 0)} packets)")
                        self._seen[key] = packets
                if len(self._seen) > 100_000:
                    self._seen.clear()


def _host_networks() -> list[ipaddress.IPv4Network]:
    from pyroute2 import IPRoute

    nets = []
    with IPRoute() as ipr:
        for r in ipr.get_routes(family=2):
            dst = r.get_attr("RTA_DST")
            if dst and r["dst_len"] > 0:
                net = ipaddress.IPv4Network(f"{dst}/{r['dst_len']}", strict=False)
                if not net.subnet_of(POOL):  # other edges' blocks are guarded by their locks
                    nets.append(net)
    return nets


def _host_addresses() -> set[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return {str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr()}
