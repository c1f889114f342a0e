"""The README's "A cluster on Ray" commands, run as a new user runs them, on hosts that
reach each other only across real addresses, never loopback: on this machine as it is (its
own address), and on two hosts of a namespace bed (dsec.cluster.netbed: each a network
namespace with its own address on a bridge). `ray start --head`, `ray start --address`,
`dsec cluster up --ray-address auto` without `--db` (so the private PostgreSQL, which
must admit every node), `dsec cluster status`, then creates, commands and files through
each replica from this machine, and `dsec cluster down`. A private PostgreSQL that
admitted only loopback passed every other cluster test, all of them on 127.0.0.1.

The Ray flags past the README's (one CPU, a 100 MB object store, no dashboard, no usage
stats) bound Ray on this 2-core machine; each host keeps its Ray files apart
(RAY_TMPDIR), as separate machines do. The store is a real MooseFS mount."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

import dsec
from dsec.cluster.netbed import NetBed
from dsec.layers.store import LayerStore
from dsec.storage.moosefs import MooseFS
from tests.conftest import SHARED_LAYERS, SRC_DATA

BIN = os.path.dirname(sys.executable)
RAY_BOUNDS = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats"]


@dataclass
class Hosts:
    """Where the commands run: this machine (``bed`` None), or the bed's hosts."""
    root: str
    bed: NetBed | None
    tmp: dict[int, str] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.bed.hosts if self.bed else [1]

    def env(self, i: int) -> dict[str, str]:
        if i not in self.tmp:
            self.tmp[i] = tempfile.mkdtemp(prefix=f"rt{i}-", dir="/tmp")  # short: Ray's sockets live there
        return {**os.environ, "RAY_TMPDIR": self.tmp[i]}

    def run(self, i: int, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = [os.path.join(BIN, argv[0]), *argv[1:]]
        if self.bed:
            cmd = self.bed.argv(i, cmd)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(i))

    def down(self) -> None:
        """Every process these hosts' Ray started (they carry its RAY_TMPDIR), then the bed."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_with_env({f"RAY_TMPDIR={t}" for t in self.tmp.values()}):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while _pids_with_env({f"RAY_TMPDIR={t}" for t in self.tmp.values()}) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.bed:
            self.bed.down()
        for t in self.tmp.values():
            shutil.rmtree(t, ignore_errors=True)


def _pids_with_env(marks: set[str]) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().decode(errors="replace").split("\0"))
        except OSError:
            continue
        if env & marks and int(pid) != os.getpid():
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="dsec-hosts-fs-")
    fs = MooseFS(root)
    fs.start()
    try:
        path = os.path.join(fs.mount, "dsec")
        os.makedirs(path, exist_ok=True)
        LayerStore(path, "sharedfs").link_from(os.path.join(SRC_DATA, "layers"), SHARED_LAYERS)
        yield path
    finally:
        fs.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["this machine", "two hosts"])
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    # PostgreSQL runs as its own user: the data root must be reachable through every parent
    root = tempfile.mkdtemp(prefix="dsec-hosts-")
    os.chmod(root, 0o711)
    bed = NetBed(f"h{os.getpid() % 10000}", 2).up() if request.param == "two hosts" else None
    h = Hosts(root, bed)
    try:
        yield h
    finally:
        h.down()
        with open("/proc/self/mountinfo") as f:
            left = [ln.split()[4] for ln in f if root in ln]
        for m in sorted(left, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _ok(out: subprocess.CompletedProcess[str], what: str) -> str:
    assert out.returncode == 0, f"{what} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


async def test_the_readme_cluster_commands_work_across_real_addresses(hosts: Hosts, store: str) -> None:
    head, *others = hosts.ids
    _ok(hosts.run(head, "ray", "start", "--head", "--resources", '{"dsec_edge": 1}', "--include-dashboard=false",
                  *RAY_BOUNDS), "ray start --head")
    head_ip = hosts.bed.addr(head) if hosts.bed else _ray_head_ip(hosts)
    assert not ipaddress.ip_address(head_ip).is_loopback
    for i in others:
        _ok(hosts.run(i, "ray", "start", f"--address={head_ip}:6379", "--resources", '{"dsec_edge": 1}',
                      *RAY_BOUNDS), f"ray start on host {i}")
    data_root = os.path.join(hosts.root, "cluster")
    up = _ok(hosts.run(head, "dsec", "cluster", "up", "--ray-address", "auto", "--store", store, "--apiservers", "2",
                       "--data-root", data_root), "dsec cluster up")
    try:
        urls = re.search(r"apiservers: (\S+)", up)
        assert urls, up
        replicas = urls.group(1).split(",")
        addrs = {hosts.bed.addr(i) for i in hosts.ids} if hosts.bed else {head_ip}
        assert len(replicas) == 2 and {httpx.URL(u).host for u in replicas} <= addrs, replicas
        # the private database listens on the head's address and admits the hosts' network
        hba = open(os.path.join(data_root, "postgres", "pg_hba.conf")).read()
        assert str(ipaddress.ip_interface(f"{head_ip}/24").network) in hba or head_ip in hba, hba[-600:]
        status = _ok(hosts.run(head, "dsec", "cluster", "status", "--ray-address", "auto", "--json"), "status")
        assert status.count('"state": "active"') == len(hosts.ids), status[-2000:]
        token = open(os.path.join(data_root, "token")).read().strip()
        await _use_each_replica(replicas, token, len(hosts.ids))
    finally:
        down = hosts.run(head, "dsec", "cluster", "down", "--ray-address", "auto", "--stop-sandboxes")
    _ok(down, "dsec cluster down")


def _ray_head_ip(hosts: Hosts) -> str:
    out = _ok(hosts.run(1, "python", "-c", "import ray; ray.init(address='auto', logging_level='error'); "
                                           "print(ray.util.get_node_ip_address())"), "the head's address")
    return out.strip().splitlines()[-1]


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


def test_a_node_is_named_as_an_edge_can_be_named() -> None:
    """Host names have dots, dashes and capitals; an edge's name (its sandboxes' id prefix)
    has none: a node named by its host became an edge whose sandbox ids no client parses."""
    from dsec.cluster.actors import edge_name
    from dsec.wire.models import EDGE_NAME_RE, parse_sandbox_id

    names = [edge_name({"NodeManagerHostname": "ip-10-0-0-7.ec2.internal", "NodeID": "AB12"}, set()),
             edge_name({"NodeManagerHostname": "vm", "NodeID": "c12274ab"}, {"vm"}),
             edge_name({"NodeManagerHostname": "9-Node", "NodeID": "ff"}, set()),
             edge_name({"Labels": {"dsec-edge-name": "r1"}, "NodeID": "x"}, set())]
    assert names == ["ip10007", "vmc12274", "n9node", "r1"]
    assert all(EDGE_NAME_RE.match(n) and parse_sandbox_id(f"{n}-0123456789ab") == n for n in names)


def test_the_private_database_admits_its_network_and_says_what_to_fix_for_others() -> None:
    """The private PostgreSQL on a real address: a node of its subnet gets in; one from
    another network is refused with a one-line error naming the address, the port and the
    fix (`--db-allow`), and gets in once that network is named."""
    from dsec.cluster import postgres

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
            probe = ("import sys\nfrom dsec.meta.db import open_db\ntry:\n    open_db(sys.argv[1])\n"
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
