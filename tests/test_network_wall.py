"""Sandboxes walled off from the cluster's own services (dsec.node.edge.network.wall), on
hosts of a namespace bed (dsec.control.cluster.netbed): an edge's network manager in cluster mode
(its registry a metadata database of this test's), a sandbox's network namespace it wires,
and two "hosts" each serving a raw TCP port and HTTP on port 80. Once one host is named
in the cluster's addresses, the sandbox loses it within seconds, through the kernel (a
raw rule) and through the egress gate (an allowed name), while the other host stays
reachable; the wall holds against a new raw rule (400 naming the address), and an edge
restarted with its database gone walls off the same addresses from its file.

Every destination here is a namespace this test makes; nothing outside the machine."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.control.cluster.netbed import NetBed
from dsec.node.edge.network.manager import NetworkManager
from dsec.node.edge.network.nft import LibNft
from dsec.node.edge.network.wall import SETTING, edge_key
from dsec.shared.errors import InvalidRequest
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.registry import Registry

RAW_PORT = 7070
# each host: a TCP server answering "pong" on RAW_PORT and an HTTP one on 80 answering "hello HOST"
SERVER = r"""
import socket, sys, threading
def serve(port, reply):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        try:
            c.settimeout(3); c.recv(4096); c.sendall(reply)
        except OSError:
            pass
        c.close()
body = ("hello " + sys.argv[1]).encode()
threading.Thread(target=serve, args=(80, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % len(body) + body), daemon=True).start()
serve(int(sys.argv[2]), b"pong\n")
"""
RAW = ("import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 2); "
       "s.sendall(b'ping'); print(s.recv(10).decode().strip())")
HTTP = ("import socket,sys; s=socket.create_connection((sys.argv[1], 80), 2); s.settimeout(3); "
        "s.sendall(b'GET / HTTP/1.1\\r\\nHost: ' + sys.argv[1].encode() + b'\\r\\n\\r\\n'); "
        "r = s.recv(4096).decode(errors='replace').splitlines(); print(r[0], '|', r[-1])")


@pytest.fixture(scope="module")
def bed() -> Iterator[NetBed]:
    b = NetBed("wall", 2).up()
    servers = [subprocess.Popen(b.argv(i, [sys.executable, "-c", SERVER, b.addr(i), str(RAW_PORT)]))
               for i in b.hosts]
    try:
        deadline = time.monotonic() + 20
        for i in b.hosts:  # listening on both ports
            while subprocess.run(b.argv(i, ["ss", "-Htln", f"sport = :{RAW_PORT}"]), capture_output=True,
                                 text=True).stdout.strip() == "":
                assert time.monotonic() < deadline, "the bed's servers did not start"
                time.sleep(0.1)
        yield b
    finally:
        for p in servers:
            p.kill()
            p.wait()
        b.down()


class Sandbox:
    """A network namespace (a process's, as a container's init holds one) the manager wires."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "--net", "sleep", "600"])
        self.pid = self.proc.pid
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline
            time.sleep(0.02)

    async def run(self, code: str, *args: str) -> tuple[int, str]:
        p = await asyncio.create_subprocess_exec(
            "nsenter", f"--net=/proc/{self.pid}/ns/net", "--", sys.executable, "-c", code, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(p.communicate(), 20)
        return p.returncode or 0, out.decode().strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
async def setup(bed: NetBed, tmp_path: str) -> AsyncIterator[tuple[NetworkManager, Registry, Sandbox, list[str]]]:
    registry = Registry(open_db(sqlite_url(str(tmp_path))))
    events: list[str] = []
    a, b = bed.addr(1), bed.addr(2)
    nm = NetworkManager(str(tmp_path), str(tmp_path), [f"hosta={a}", f"hostb={b}"],
                        on_event=lambda sid, kind, msg: events.append(f"{kind} {msg}"))
    nm.use_cluster(registry, "wall1")
    await nm.start()
    sb = Sandbox()
    try:
        yield nm, registry, sb, events
    finally:
        await nm.detach("wall1-sandbox")
        await nm.close(keep=False)
        sb.stop()


async def _until(check, what: str, timeout: float = 8.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


def _cluster_rule_handle(table: str) -> int:
    out = subprocess.run(["nft", "-a", "list", "chain", "inet", table, "forward"], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(r"ip daddr @cluster .*# handle (\d+)", out)
    assert m, out
    return int(m.group(1))


async def test_a_host_named_in_the_cluster_is_lost_within_seconds_the_other_stays(
        bed: NetBed, setup: tuple[NetworkManager, Registry, Sandbox, list[str]]) -> None:
    nm, registry, sb, events = setup
    a, b = bed.addr(1), bed.addr(2)
    # this node's own addresses are published for the other edges at once
    await _until(lambda: asyncio.to_thread(lambda: registry.setting(edge_key("wall1")) is not None),
                 "the edge publishes its node's addresses")
    own = json.loads(registry.setting(edge_key("wall1")) or "[]")
    assert bed.addr(0) in own and "127.0.0.1" in own, own
    await nm.attach("wall1-sandbox", sb.pid, {f"{a}:{RAW_PORT}/tcp": True, f"{b}:{RAW_PORT}/tcp": True,
                                              "hosta": True, "hostb": True})
    for host in (a, b):  # reachable both ways: the raw rule in the kernel, the name through the gate
        assert await sb.run(RAW, host, str(RAW_PORT)) == (0, "pong")
        assert await sb.run(HTTP, host) == (0, f"HTTP/1.1 200 OK | hello {host}")

    registry.put_setting(SETTING, json.dumps([a]))  # host a is the cluster's now (a Ray node, say)

    async def raw_lost() -> bool:
        return (await sb.run(RAW, a, str(RAW_PORT)))[0] != 0
    took = await _until(raw_lost, "host a walled off in the kernel")
    assert took < 5.0, took  # refreshed every 2 s
    code, out = await sb.run(HTTP, a)  # the gate answers for it, and refuses: it never connects there
    assert out.startswith("HTTP/1.1 403 Forbidden") and "hello" not in out, out
    for host in (b,):  # the other host: unchanged
        assert await sb.run(RAW, host, str(RAW_PORT)) == (0, "pong")
        assert await sb.run(HTTP, host) == (0, f"HTTP/1.1 200 OK | hello {host}")
    # a new raw rule naming it is refused, naming the address; a rule already there is kept
    # (the kernel drops its traffic whatever it says)
    with pytest.raises(InvalidRequest) as e:
        await nm.update("wall1-sandbox", {f"{a}:{RAW_PORT + 1}/tcp": True})
    assert e.value.field == "network_rules" and a in e.value.message and "cluster" in e.value.message
    with pytest.raises(InvalidRequest):
        nm.validate({f"{a.rsplit('.', 1)[0]}.0/24:22/tcp": True})  # a network holding it, too
    nm.validate({f"{b}:22/tcp": True})
    await asyncio.sleep(2.5)  # the kernel's rejections are collected every 2 s
    assert any(f"{a}:{RAW_PORT}" in e for e in events if e.startswith("egress_denied")), events
    # the drop rule is what walls it (not some other rule): without it, host a is back
    table = nm.table.name  # type: ignore[union-attr]
    handle = _cluster_rule_handle(table)
    LibNft().run(f"delete rule inet {table} forward handle {handle}")
    assert await sb.run(RAW, a, str(RAW_PORT)) == (0, "pong")


async def test_a_restarted_edge_walls_off_from_its_file_while_the_database_is_down(
        bed: NetBed, tmp_path: str) -> None:
    a, b = bed.addr(1), bed.addr(2)
    db_dir = os.path.join(str(tmp_path), "db")
    os.makedirs(db_dir)
    registry = Registry(open_db(sqlite_url(db_dir)))
    registry.put_setting(SETTING, json.dumps([a]))
    root = os.path.join(str(tmp_path), "edge")
    os.makedirs(root)
    nm = NetworkManager(root, root)
    nm.use_cluster(registry, "wall2")
    await nm.start()
    try:
        await _until(lambda: asyncio.sleep(0, bool(nm.wall.nets)), "the wall read from the database")
    finally:
        await nm.close(keep=False)
    with open(os.path.join(root, "cluster_addresses.json")) as f:
        assert a + "/32" in json.load(f)["entries"]

    class Down:  # a database that does not answer
        def put_setting(self, *_: object) -> None:
            raise ConnectionError("database down")

        def settings_like(self, *_: object) -> dict[str, str]:
            raise ConnectionError("database down")

    nm = NetworkManager(root, root)
    nm.use_cluster(Down(), "wall2")
    await nm.start()
    sb = Sandbox()
    try:
        await nm.attach("wall2-sandbox", sb.pid, {f"{b}:{RAW_PORT}/tcp": True})
        with pytest.raises(InvalidRequest):
            nm.validate({f"{a}:{RAW_PORT}/tcp": True})
        assert a in LibNft().run(f"list set inet {nm.table.name} cluster")  # type: ignore[union-attr]
        assert await sb.run(RAW, b, str(RAW_PORT)) == (0, "pong")
    finally:
        await nm.detach("wall2-sandbox")
        await nm.close(keep=False)
        sb.stop()


def test_the_cluster_addresses_published_and_read(tmp_path: str) -> None:
    """What the controller publishes (every part of the cluster, and --protect), and how an
    edge reads it: names resolved on the node, a name that stops resolving keeping the
    addresses it had (here one that never resolves: .invalid, RFC 6761)."""
    from dsec.control.cluster.actors import cluster_entries
    from dsec.control.cluster.config import ClusterConfig
    from dsec.node.edge.network.wall import ClusterWall

    cfg = ClusterConfig(db="postgresql://dsec:pw@db.example:5432/dsec", secret="s" * 16, admin_token="t" * 16,
                        protect=["10.5.0.0/16", "Meta.Internal."])
    got = cluster_entries(cfg, [{"NodeManagerAddress": "10.0.0.7"}, {"NodeManagerAddress": "10.0.0.8"}],
                          ["http://10.0.0.8:7801"], ["http://[fd00::9]:7777"], "10.0.0.10")
    assert got == ["10.0.0.10/32", "10.0.0.7/32", "10.0.0.8/32", "10.5.0.0/16", "db.example", "fd00::9/128",
                   "meta.internal"]
    registry = Registry(open_db(sqlite_url(str(tmp_path))))
    registry.put_setting(SETTING, json.dumps(["localhost", "gone.invalid", "10.1.0.0/16", "not a name!"]))
    path = os.path.join(str(tmp_path), "cluster_addresses.json")
    with open(path, "w") as f:  # what an earlier read found, when gone.invalid still resolved
        json.dump({"entries": ["gone.invalid"], "resolved": {"gone.invalid": ["10.9.9.9"]}}, f)
    w = ClusterWall(path, registry, "e1")
    assert [str(n) for n in w.nets] == ["10.9.9.9/32"]  # in force from the file, before any read
    assert w.refresh()
    nets = {str(n) for n in w.nets}
    assert {"127.0.0.1/32", "10.9.9.9/32", "10.1.0.0/16"} <= nets, nets
    own = json.loads(registry.setting(edge_key("e1")) or "[]")
    assert "127.0.0.1" in own and not any(a.startswith("10.211.") for a in own)
    assert {str(n) for n in w.nets} >= {f"{a}/32" for a in own if ":" not in a}  # its own, read back
    assert not w.refresh()  # nothing new
    with open(path) as f:
        assert json.load(f)["resolved"]["gone.invalid"] == ["10.9.9.9"]


def test_cluster_up_protect_names_a_bad_entry(tmp_path: str) -> None:
    out = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "cluster", "up", "--store", str(tmp_path),
                          "--protect", "10.0.0.0/8", "--protect", "not a host!"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--protect" in out.stderr and "not a host!" in out.stderr, out.stderr
