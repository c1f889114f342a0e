"""The README's "A cluster on Ray" commands, run as a new user runs them, on hosts that
reach each other only across real addresses, never loopback: on this machine as it is (its
own address), and on two hosts of a namespace bed (dsec.control.cluster.netbed: each a network
namespace with its own address on a bridge). `ray start --head`, `ray start --address`,
`dsec cluster up --ray-address auto` without `--db` (so the private PostgreSQL, which
must admit every node), `dsec cluster status`, then creates, commands and files through
each replica from this machine, and `dsec cluster down`. A private PostgreSQL that
admitted only loopback passed every other cluster test, all of them on 127.0.0.1.

The Ray flags past the README's (one CPU, a 100 MB object store, no dashboard, no usage
stats) bound Ray on this 2-core machine; each host keeps its Ray files apart
(RAY_TMPDIR), as separate machines do. The store is a real MooseFS mount."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import dsec
from dsec.control.cluster.netbed import RAY_BOUNDS, NetBed, RayHosts
from dsec.node.layers.store import LayerStore
from dsec.node.storage.moosefs import MooseFS
from tests.conftest import SHARED_LAYERS, SRC_DATA


@dataclass
class Hosts:
    root: str
    ray: RayHosts
    store: str


@pytest.fixture(params=["this machine", "two hosts"])
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    # PostgreSQL runs as its own user: the data root must be reachable through every parent
    root = tempfile.mkdtemp(prefix="dsec-hosts-")
    os.chmod(root, 0o711)
    bed = NetBed(f"h{os.getpid() % 10000}", 2).up() if request.param == "two hosts" else None
    # the store: MooseFS, mounted on the bed from its first host, across the bridge
    fs = MooseFS(os.path.join(root, "moosefs"), *((bed.addr(0), f"{bed.addr(0)}/24", bed.argv(1, []))
                                                  if bed else ()))
    h = Hosts(root, RayHosts(bed), os.path.join(fs.mount, "dsec"))
    try:
        fs.start()
        os.makedirs(h.store, exist_ok=True)
        LayerStore(h.store, "sharedfs").link_from(os.path.join(SRC_DATA, "layers"), SHARED_LAYERS)
        yield h
    finally:
        fs.stop()
        h.ray.down()
        with open("/proc/self/mountinfo") as f:
            left = [ln.split()[4] for ln in f if root in ln]
        for m in sorted(left, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(root, ignore_errors=True)


async def test_the_readme_cluster_commands_work_across_real_addresses(hosts: Hosts) -> None:
    ray, bed = hosts.ray, hosts.ray.bed
    head_ip = ray.start_ray()  # `ray start --head`, then `ray start --address=HEAD:6379` on the others
    assert not ipaddress.ip_address(head_ip).is_loopback
    data_root = os.path.join(hosts.root, "cluster")
    replicas, token = ray.cluster_up(hosts.store, data_root)  # `dsec cluster up --ray-address auto`, no --db
    try:
        addrs = {bed.addr(i) for i in ray.ids} if bed else {head_ip}
        assert len(replicas) == 2 and {httpx.URL(u).host for u in replicas} <= addrs, replicas
        # the private database listens on the head's address and admits the hosts' network
        hba = open(os.path.join(data_root, "postgres", "pg_hba.conf")).read()
        assert str(ipaddress.ip_interface(f"{head_ip}/24").network) in hba or head_ip in hba, hba[-600:]
        status = ray.ok(ray.ids[0], "dsec", "cluster", "status", "--ray-address", "auto", "--json")
        assert status.count('"state": "active"') == len(ray.ids), status[-2000:]
        await _use_each_replica(replicas, token, len(ray.ids))
        if bed:
            await _lose_a_host_and_bring_it_back(ray, head_ip, token, json.loads(status)["edges"], data_root)
    finally:
        down = ray.run(ray.ids[0], "dsec", "cluster", "down", "--ray-address", "auto", "--stop-sandboxes")
    assert down.returncode == 0, down.stderr[-2000:]


async def _use_each_replica(replicas: list[str], token: str, edges: int) -> None:
    """From this machine, through each replica: sandboxes on every edge, a command and a
    file in each, the other replica reading what one wrote."""
    made: list[dsec.AsyncSandbox] = []
    async with dsec.AsyncClient(url=replicas[0], token=token) as a, \
            dsec.AsyncClient(url=replicas[1], token=token) as b:
        try:
            assert len({n.edge for n in await a.nodes() if n.healthy}) == edges
            for _ in range(30):
                if len({sb.sandbox_id.rsplit("-", 1)[0] for sb in made}) == edges and len(made) >= 2:
                    break
                made.append(await (a, b)[len(made) % 2].run_container(dsec.ContainerArgs(image="base/busybox")))
            assert len({sb.sandbox_id.rsplit("-", 1)[0] for sb in made}) == edges, [sb.sandbox_id for sb in made]
            for sb in made:
                other = await (b if sb in made[::2] else a).connect(sb.sandbox_id)
                assert (await sb.exec(["sh", "-c", "echo hi"])).stdout == "hi\n"
                await sb.write_file("/tmp/f", b"from " + sb.sandbox_id.encode())
                assert await other.read_file("/tmp/f") == b"from " + sb.sandbox_id.encode()
        finally:
            for sb in made:
                await sb.stop()


def _replicas(ray: RayHosts, but: str = "") -> list[str]:
    """The replicas' URLs as `cluster status` has them now, those on host ``but`` left out:
    a replica of a lost host is started again elsewhere, under another URL (once both were
    on the host lost, and a client holding the first URLs had none left)."""
    for _ in range(120):
        out = ray.run(ray.ids[0], "dsec", "cluster", "status", "--ray-address", "auto", "--json")
        if out.returncode == 0:
            urls = [u for u in json.loads(out.stdout)["apiservers"].values() if httpx.URL(u).host != but]
            up = []
            for u in urls:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{u}/healthz", timeout=2).status_code == 200:
                        up.append(u)
            if up:
                return up
        time.sleep(2)
    raise AssertionError(f"no replica answers: {out.stdout[-1500:]} {out.stderr[-1500:]}")


async def _lose_a_host_and_bring_it_back(ray: RayHosts, head_ip: str, token: str, edges: list[dict[str, Any]],
                                         data_root: str) -> None:
    """Host 2 dies as a machine cut off does (Ray's processes killed, and with them its edge
    daemon; its sandboxes run on): they are reported failed, "node lost", through the
    replicas left; `ray start` there again and its edge comes back under its old name (the
    name stays with its address) and stops what it left."""
    assert ray.bed is not None
    lost_ip = ray.bed.addr(2)
    mine = next(e["name"] for e in edges if httpx.URL(e["url"]).host == lost_ip)
    async with dsec.AsyncClient(url=",".join(_replicas(ray)), token=token) as c:
        there = None
        for _ in range(40):
            sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="lost"))
            if sb.sandbox_id.rsplit("-", 1)[0] == mine:
                there = sb
                break
        assert there is not None, f"nothing placed on {mine}"
    for pid in ray.bed.pids(2):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"ray" in f.read():
                os.kill(pid, signal.SIGKILL)

    async def state() -> str:
        async with dsec.AsyncClient(url=",".join(_replicas(ray, but=lost_ip)), token=token) as c:
            try:
                info = (await c.connect(there.sandbox_id)).info
            except dsec.DsecError as e:
                return f"error {e}"
            return f"{info.state.value} {info.error or ''}"
    deadline = time.monotonic() + 180
    while (now := await state()) != "failed node lost" and time.monotonic() < deadline:
        await asyncio.sleep(2)
    assert now == "failed node lost", now
    ray.ok(2, "ray", "start", f"--address={head_ip}:6379", "--resources", '{"dsec_edge": 1}', *RAY_BOUNDS)
    deadline = time.monotonic() + 300  # (under a benchmark's load here: once over 3 min, once 1)
    while not (now := await state()).startswith("stopped") and time.monotonic() < deadline:
        await asyncio.sleep(2)
    if not now.startswith("stopped"):
        st = ray.run(1, "dsec", "cluster", "status", "--ray-address", "auto", "--json").stdout[-3000:]
        with open(os.path.join(data_root, mine, "edge.log"), errors="replace") as f:
            log = f.read()[-3000:]
        raise AssertionError(f"{now!r}: the returned edge did not stop what it left; status {st}; log {log}")
    status = json.loads(ray.ok(1, "dsec", "cluster", "status", "--ray-address", "auto", "--json"))
    back = {e["name"]: e for e in status["edges"]}
    assert back[mine]["state"] == "active" and httpx.URL(back[mine]["url"]).host == lost_ip, back
    async with dsec.AsyncClient(url=",".join(_replicas(ray)), token=token) as c:
        await c.stop_many(job="lost")


def test_a_node_is_named_as_an_edge_can_be_named() -> None:
    """Host names have dots, dashes and capitals; an edge's name (its sandboxes' id prefix)
    has none: a node named by its host became an edge whose sandbox ids no client parses."""
    from dsec.control.cluster.actors import edge_name
    from dsec.shared.wire.models import EDGE_NAME_RE, parse_sandbox_id

    names = [edge_name({"NodeManagerHostname": "ip-10-0-0-7.ec2.internal", "NodeID": "AB12"}, set()),
             edge_name({"NodeManagerHostname": "vm", "NodeID": "c12274ab", "NodeManagerAddress": "10.213.0.12"},
                       {"vm"}),
             edge_name({"NodeManagerHostname": "vm", "NodeID": "C12274AB"}, {"vm"}),
             edge_name({"NodeManagerHostname": "9-Node", "NodeID": "ff"}, set()),
             edge_name({"Labels": {"dsec-edge-name": "r1"}, "NodeID": "x"}, set())]
    assert names == ["ip10007", "vm10213012", "vmc12274ab", "n9node", "r1"]
    assert all(EDGE_NAME_RE.match(n) and parse_sandbox_id(f"{n}-0123456789ab") == n for n in names)
    # a name stays with the address that first had it: the survivor of two nodes sharing a
    # host name keeps its own name when the other is lost, and the lost one gets its back
    a = {"NodeManagerHostname": "vm", "NodeID": "n1", "NodeManagerAddress": "10.213.0.11"}
    b = {"NodeManagerHostname": "vm", "NodeID": "n2", "NodeManagerAddress": "10.213.0.12"}
    known = {"vm": "10.213.0.11", "vm10213012": "10.213.0.12"}
    assert edge_name(b, set(), known) == "vm10213012"
    assert edge_name({**a, "NodeID": "n1again"}, {"vm10213012"}, known) == "vm"
    assert edge_name({**b, "NodeManagerAddress": "10.213.0.13"}, {"vm"}, known) == "vm10213013"
    # nodes that share an address as well are told apart by their Ray ids
    same = {"NodeManagerHostname": "vm", "NodeManagerAddress": "127.0.0.1"}
    first = edge_name({**same, "NodeID": "aa"}, set())
    second = edge_name({**same, "NodeID": "bb"}, {first})
    third = edge_name({**same, "NodeID": "cc"}, {first, second})
    assert len({first, second, third}) == 3, (first, second, third)


def test_the_private_database_admits_its_network_and_says_what_to_fix_for_others() -> None:
    """The private PostgreSQL on a real address: a node of its subnet gets in; one from
    another network is refused with a one-line error naming the address, the port and the
    fix (`--db-allow`), and gets in once that network is named."""
    from dsec.control.cluster import postgres

    bed = NetBed(f"p{os.getpid() % 10000}", 2).up()
    root = tempfile.mkdtemp(prefix="dsec-pg-hosts-")
    os.chmod(root, 0o711)
    try:
        assert bed.net is not None
        outside = str(ipaddress.IPv4Network(bed.net).network_address + (1 << 8) + 2)  # the next /24
        # host 2 speaks to the machine from an address of another network (routed back here)
        subprocess.run(["ip", "-n", bed.ns(2), "addr", "add", f"{outside}/32", "dev", "eth0"], check=True)
        subprocess.run(["ip", "-n", bed.ns(2), "route", "add", f"{bed.addr(0)}/32", "dev", "eth0", "src", outside],
                       check=True)
        subprocess.run(["ip", "route", "add", f"{outside}/32", "dev", bed.bridge], check=True)
        pg = postgres.Postgres(os.path.join(root, "data"), host=bed.addr(0), port=5433)
        url = pg.start()
        try:
            assert httpx.URL(url.replace("postgresql", "http")).host == bed.addr(0)
            probe = ("import sys\nfrom dsec.shared.meta.db import open_db\ntry:\n    open_db(sys.argv[1])\n"
                     "except Exception as e:\n    print(type(e).__name__, e)\nelse:\n    print('connected')\n")

            def connect(i: int) -> str:
                out = subprocess.run(bed.argv(i, [sys.executable, "-c", probe, url]), capture_output=True,
                                     text=True, timeout=60)
                return out.stdout.strip() or out.stderr[-2000:]

            assert connect(1) == "connected"
            refused = connect(2)
            assert refused.startswith("DatabaseUnreachable") and f"{bed.addr(0)}:5433" in refused, refused
            assert "--db-allow" in refused and "pg_hba.conf" in refused and "\n" not in refused, refused
            assert postgres.admit(pg.data_dir, postgres.networks(pg.host, [f"{outside}/24"]))
            assert pg.proc is not None
            pg.proc.send_signal(signal.SIGHUP)  # what the cluster's actor does on a later `cluster up`
            deadline = time.monotonic() + 10
            while (got := connect(2)) != "connected" and time.monotonic() < deadline:
                time.sleep(0.3)
            assert got == "connected"
            assert not postgres.admit(pg.data_dir, postgres.networks(pg.host, [f"{outside}/24"]))  # unchanged
        finally:
            pg.remove()
    finally:
        bed.down()
        shutil.rmtree(root, ignore_errors=True)


def test_cluster_up_on_a_plain_directory_says_so_at_once(tmp_path: os.PathLike[str]) -> None:
    """A newcomer's `--store /tmp/x/store` (a directory, not a shared mount): one line, at
    once, before anything starts (each edge refused it too, but only past `up`'s wait)."""
    plain = os.path.join(tmp_path, "store")
    os.makedirs(plain)
    t0 = time.monotonic()
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dsec"), "cluster", "up", "--ray-address",
                          "127.0.0.1:1", "--store", plain], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 2 and time.monotonic() - t0 < 30, (out.returncode, out.stderr)
    said = out.stderr.strip()
    assert "\n" not in said and "not a shared mount" in said and plain in said, said
