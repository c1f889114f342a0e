"""Sandbox egress policy: named services through the edge's resolver and gate, raw
ip:port rules in nftables, default deny, live changes, and what is never reachable.

The registries are the only outside services these machines reach (see MACHINE.md); the
pypi/npm test uses them for real. Every other destination here is a listener this test
starts on the host.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
from conftest import TOKEN, Platform, leftovers

import dsec
from dsec.node.edge.network.catalog import npm_hosts
from dsec.node.edge.network.nft import LibNft, NftTable
from dsec.node.edge.network.wiring import ifname_for


def _host_ip() -> str:
    """This machine's own (non-loopback) address."""
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for link in json.loads(out):
        for a in link.get("addr_info", []):
            if not a["local"].startswith("127."):
                return str(a["local"])
    raise RuntimeError("no host address")


@pytest.fixture
def listener() -> Iterator[tuple[str, int, list[bytes]]]:
    """A TCP server on all host addresses that records what it is sent."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    got: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.settimeout(2)
                try:
                    got.append(c.recv(100))
                    c.sendall(b"pong\n")
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    yield _host_ip(), srv.getsockname()[1], got
    srv.close()


CONNECT = ("python3 -c \"import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 3); "
           "s.sendall(b'ping'); print(s.recv(10).decode().strip())\" {} {}")


async def test_pypi_allowed_npm_denied_and_live_change(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(network_rules={"pypi": True, "npm": False}))
    try:
        assert sb.info.network is not None and sb.info.network.rules == {"pypi": True}
        r = await sb.run_shell("cd /tmp && pip download --no-deps --no-cache-dir -q six && ls", timeout=120)
        assert r.exit_code == 0 and ".whl" in r.stdout, r.stderr
        npm = npm_hosts()[0]
        r = await sb.run_shell(f"curl -sS -m 10 https://{npm}/left-pad", timeout=30)
        assert r.exit_code != 0 and "resolve" in r.stderr.lower(), r  # no DNS answer for a denied name
        # asking the gate directly (the shared front end's address, npm's name) is refused too
        pypi_ip = (await sb.run_shell("getent hosts pypi.org | cut -d' ' -f1")).stdout.strip()
        assert pypi_ip
        r = await sb.run_shell(f"curl -sS -m 10 --resolve {npm}:443:{pypi_ip} https://{npm}/left-pad")
        assert r.exit_code != 0, r
        events = [e.kind for e in await sb.events()]
        assert "egress_denied" in events
        info = await sb.set_network_rules({"pypi": False, "npm": True})
        assert info.rules == {"npm": True}
        r = await sb.run_shell(f"curl -sS -m 20 -o /dev/null -w '%{{http_code}}' https://{npm}/left-pad")
        assert r.stdout == "200", r
        r = await sb.run_shell("cd /tmp && pip download --no-deps --no-cache-dir -q idna", timeout=60)
        assert r.exit_code != 0
    finally:
        await sb.stop()


async def test_default_deny_raw_rules_and_host_is_out_of_reach(
        platform: Platform, client: dsec.AsyncClient, listener: tuple[str, int, list[bytes]]) -> None:
    host, port, got = listener
    sb = await client.run_container(dsec.ContainerArgs(network_rules={}))
    other = await client.run_container(dsec.ContainerArgs(network_rules={}))
    try:
        # the host's own address, the API port, link-local/metadata, another sandbox: all refused
        for target in [(host, port), ("127.0.0.1", platform.port), (host, platform.port),
                       ("169.254.169.254", 80), (other.info.network.address, 22),  # type: ignore[union-attr]
                       (sb.info.network.gateway, platform.port)]:  # type: ignore[union-attr]
            r = await sb.run_shell(CONNECT.format(*target))
            assert r.exit_code != 0, (target, r)
        assert got == []
        with pytest.raises(dsec.InvalidRequest) as e:  # the host's address is never a raw rule's ...
            await sb.set_network_rules({f"{host}:{port}/tcp": True})
        assert e.value.field == "network_rules" and "no sandbox may reach" in e.value.message
        await sb.set_network_rules({f"host:{port}/tcp": True})  # ... only the cluster admin's host: rule
        r = await sb.run_shell(CONNECT.format(host, port))
        assert r.exit_code == 0 and r.stdout.strip() == "pong", r
        assert got == [b"ping"]
        r = await other.run_shell(CONNECT.format(host, port))  # the rule is the first sandbox's alone
        assert r.exit_code != 0
        await sb.set_network_rules({f"host:{port}/tcp": False})
        r = await sb.run_shell(CONNECT.format(host, port))
        assert r.exit_code != 0
        await asyncio.sleep(2.5)  # the kernel's rejections are collected every 2 s
        denied = [e.message for e in await other.events() if e.kind == "egress_denied"]
        assert any(f"{host}:{port}" in m for m in denied), denied
    finally:
        await sb.stop()
        await other.stop()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout  # noqa: ASYNC221
    for s in (sb, other):
        assert leftovers(platform, s.sandbox_id) == []
        assert ifname_for(s.info.network.address) not in links  # type: ignore[union-attr]


async def test_spoofed_source_and_ipv6_are_dropped(client: dsec.AsyncClient,
                                                   listener: tuple[str, int, list[bytes]]) -> None:
    host, port, got = listener
    a = await client.run_container(dsec.ContainerArgs(network_rules={}))
    b = await client.run_container(dsec.ContainerArgs(network_rules={}))
    try:
        await b.set_network_rules({f"host:{port}/tcp": True})
        b_addr = b.info.network.address  # type: ignore[union-attr]
        # root in a cannot take b's address (no CAP_NET_ADMIN) ...
        r = await a.run_shell(f"ip addr add {b_addr}/32 dev eth0")
        assert r.exit_code != 0 and "not permitted" in r.stderr.lower(), r
        # ... nor send from it (IP_FREEBIND needs no privilege; the route lookup refuses, and a
        # packet that got out would die at a's veth), nor forge packets on a raw socket
        r = await a.run_shell(f"python3 -c \"import socket; s=socket.socket(); s.setsockopt(0, 15, 1); "
                              f"s.bind(('{b_addr}', 0)); s.settimeout(3); s.connect(('{host}', {port}))\"")
        assert r.exit_code != 0, r
        r = await a.run_shell("python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 6)'")
        assert r.exit_code != 0 and "not permitted" in r.stderr, r
        assert got == []
        r = await a.run_shell("cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6")
        assert r.stdout.strip() == "1"
    finally:
        await a.stop()
        await b.stop()


async def test_bad_network_rules_are_400(client: dsec.AsyncClient) -> None:
    with pytest.raises(dsec.InvalidRequest) as e:
        await client.run_container(dsec.ContainerArgs(network_rules={"no-such-service": True}))
    assert e.value.field == "network_rules" and "pypi" in e.value.message
    with pytest.raises(dsec.InvalidRequest) as e:
        await client.run_container(dsec.ContainerArgs(network_rules={"1.2.3.4:70000/tcp": True}))
    assert e.value.field == "network_rules"
    sb = await client.run_container(dsec.ContainerArgs())
    try:
        assert sb.info.network is None
        r = await sb.run_shell("ip -o link | grep -c eth0 || true")
        assert r.stdout.strip() == "0"  # no network asked for: loopback only
        with pytest.raises(dsec.InvalidRequest) as e:
            await sb.set_network_rules({"x:1/tcp": True})
        assert e.value.field == "rules"
        info = await sb.set_network_rules({"pypi": True})  # wired on first use
        assert info.rules == {"pypi": True}
        assert (await sb.run_shell("ip -o link | grep -c eth0")).stdout.strip() == "1"
    finally:
        await sb.stop()


async def test_edge_restart_keeps_links_and_rules(platform: Platform, client: dsec.AsyncClient,
                                                  listener: tuple[str, int, list[bytes]]) -> None:
    host, port, got = listener
    sb = await client.run_container(dsec.ContainerArgs(network_rules={f"host:{port}/tcp": True, "pypi": True}))
    assert (await sb.run_shell(CONNECT.format(host, port))).stdout.strip() == "pong"
    platform.restart(crash=True)
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c2:  # the old pool died with the server
        sb = await c2.connect(sb.sandbox_id)
        try:
            assert sb.info.network is not None and sb.info.network.rules == {f"host:{port}/tcp": True, "pypi": True}
            r = await sb.run_shell(CONNECT.format(host, port))
            assert r.stdout.strip() == "pong", r
            r = await sb.run_shell("getent hosts pypi.org && ! getent hosts " + npm_hosts()[0])
            assert r.exit_code == 0, r
            r = await sb.run_shell(CONNECT.format(host, platform.port))
            assert r.exit_code != 0
        finally:
            await sb.stop()


async def test_a_dead_edges_table_does_not_steal_the_subnet(tmp_path: str) -> None:
    """An edge killed for good leaves its nft table; the next edge to claim that subnet
    (its lock is free again) removes it, or the dead table would steer the new edge's DNS
    and web traffic to ports nothing serves."""
    import ipaddress

    from conftest import _seed_layers

    subnet = "10.211.224.0/19"
    stale = NftTable("dsec_deadbeef", ipaddress.IPv4Network(subnet), 1, 2)  # as a dead edge left it
    await stale.install()
    data_dir = str(tmp_path)
    _seed_layers(data_dir)
    p = Platform(data_dir, ["--sandbox-subnet", subnet])
    p.start()
    try:
        assert "dsec_deadbeef" not in LibNft().run("list tables")
        async with dsec.AsyncClient(url=p.url, token=TOKEN) as c:
            sb = await c.run_container(dsec.ContainerArgs(network_rules={"pypi": True}))
            try:
                assert sb.info.network is not None and sb.info.network.address.startswith("10.211.2")
                r = await sb.run_shell("getent hosts pypi.org")
                assert r.exit_code == 0 and r.stdout.strip(), r
            finally:
                await sb.stop()
    finally:
        p.stop()
        if "dsec_deadbeef" in LibNft().run("list tables"):
            await stale.remove()
