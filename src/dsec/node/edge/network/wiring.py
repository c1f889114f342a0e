"""A sandbox's network link: a routed veth pair between the host and the sandbox's
network namespace (no bridge, so sandboxes share no L2 segment).

Each sandbox has a /31 from its edge's subnet: the even address on the host end, the odd
one on ``eth0`` inside, with the host end as default gateway. IPv6 is switched off on
both ends. Netlink work goes through pyroute2; the sandbox side is configured from a
thread that has entered the sandbox's network namespace (setns is per thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os

from dsec.node.host import linux


def ifname_for(sandbox_ip: str) -> str:
    """Host-side interface name: unique on the host because sandbox addresses are."""
    return f"dsv{int(ipaddress.IPv4Address(sandbox_ip)) & 0xFFFFFF:06x}"


def _sysctl(path: str, value: str) -> None:
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(value)


def _wire(netns_path: str, host_if: str, host_ip: str, sandbox_ip: str) -> None:
    from pyroute2 import IPRoute  # imported late: a few hundred ms, only for networked sandboxes

    peer = host_if.replace("dsv", "dsp", 1)
    nsfd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with IPRoute() as ipr:
            for stale in ipr.link_lookup(ifname=host_if):  # left by a crash mid-wiring
                ipr.link("del", index=stale)
            ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": peer, "net_ns_fd": nsfd})
            idx = ipr.link_lookup(ifname=host_if)[0]
            _sysctl(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6", "1")
            ipr.addr("add", index=idx, address=host_ip, prefixlen=31)
            ipr.link("set", index=idx, state="up")

        def inside() -> None:
            with IPRoute() as ipr:
                idx = ipr.link_lookup(ifname=peer)[0]
                ipr.link("set", index=idx, ifname="eth0")
                _sysctl("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1")
                ipr.addr("add", index=idx, address=sandbox_ip, prefixlen=31)
                ipr.link("set", index=idx, state="up")
                ipr.route("add", dst="0.0.0.0/0", gateway=host_ip)

        linux.in_netns(netns_path, inside)
    finally:
        os.close(nsfd)


def _unwire(host_if: str) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for idx in ipr.link_lookup(ifname=host_if):
            with contextlib.suppress(NetlinkError):
                ipr.link("del", index=idx)


async def wire(init_pid: int, host_if: str, host_ip: str, sandbox_ip: str) -> None:
    await asyncio.to_thread(_wire, f"/proc/{init_pid}/ns/net", host_if, host_ip, sandbox_ip)


async def unwire(host_if: str) -> None:
    """Remove the host end (the pair goes with it); the sandbox's namespace ending does the same."""
    await asyncio.to_thread(_unwire, host_if)


def enable_forwarding() -> None:
    _sysctl("/proc/sys/net/ipv4/ip_forward", "1")
