"""Several hosts on one machine, for the tests and the cluster demo: each "host" a network
namespace with its own address on a bridge (a veth pair each), so a cluster on them
reaches its database, edges, replicas, Ray and store across real addresses, never
loopback, as it would across machines (issue: a private PostgreSQL that admitted only
loopback passed every test that put all daemons on 127.0.0.1). The filesystem and
processes are the machine's: only the network is per host. The machine itself holds the
bridge's first address, so a client on it reaches every host as one on the same LAN would.

Everything is named after ``tag`` (short: interface names hold 15 characters) and removed
by :meth:`NetBed.down`, which also ends whatever still runs in the namespaces."""

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
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsec.control.cluster import rayauth

# what bounds Ray on a small machine: one CPU, a 100 MB object store, no usage report
RAY_BOUNDS = ("--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _taken() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr").stdout.split()
    return [ipaddress.IPv4Interface(w).network for w in out if "/" in w and w[0].isdigit()]


class NetBed:
    """``hosts`` namespaces ``dsec-TAG-1``..N on bridge ``dsbTAG``, at .11, .12, ... of a
    free /24 in 10.213.0.0/16 (the machine at .1)."""

    def __init__(self, tag: str, hosts: int) -> None:
        if not (tag.isalnum() and len(tag) <= 6):
            raise ValueError(f"tag {tag!r}: at most 6 letters or digits")
        self.tag, self.count = tag, hosts
        self.bridge = f"dsb{tag}"
        self.net: ipaddress.IPv4Network | None = None

    def ns(self, i: int) -> str:
        return f"dsec-{self.tag}-{i}"

    def addr(self, i: int) -> str:
        """Host ``i``'s address (1-based); 0: the machine's own on the bridge."""
        assert self.net is not None
        return str(self.net.network_address + (1 if i == 0 else 10 + i))

    @property
    def hosts(self) -> list[int]:
        return list(range(1, self.count + 1))

    def up(self) -> NetBed:
        taken = _taken()
        self.net = next(n for n in ipaddress.IPv4Network("10.213.0.0/16").subnets(new_prefix=24)
                        if not any(n.overlaps(t) for t in taken))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.addr(0)}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in self.hosts:
                ns, outside = self.ns(i), f"dsv{self.tag}{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                for args in (("addr", "add", f"{self.addr(i)}/24", "dev", "eth0"), ("link", "set", "lo", "up"),
                             ("link", "set", "eth0", "up"), ("route", "add", "default", "via", self.addr(0))):
                    _ip("-n", ns, *args)
        except BaseException:
            self.down()
            raise
        return self

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``i``: in its network namespace only (``ip netns exec`` would
        also remount /sys, hiding the cgroup hierarchies a host's edge runs its sandboxes in)."""
        return ["nsenter", f"--net=/run/netns/{self.ns(i)}", "--", *argv]

    def run(self, i: int, argv: Sequence[str], timeout: float = 300, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(self.argv(i, argv), capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
        if check and out.returncode != 0:
            raise RuntimeError(f"on host {i}: {' '.join(argv)} exited {out.returncode}:\n"
                               f"{(out.stderr or out.stdout)[-3000:]}")
        return out

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.ns(i), check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def down(self) -> None:
        """End what runs on the hosts (SIGTERM, then SIGKILL after 10 s), remove the
        namespaces, their veths and the bridge. Safe to call twice."""
        names = set(_ip("netns", "list", check=False).stdout.split())
        mine = [i for i in self.hosts if self.ns(i) in names]
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for i in mine:
                for pid in self.pids(i):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while any(self.pids(i) for i in mine) and time.monotonic() < deadline:
                time.sleep(0.2)
        for i in mine:
            _ip("netns", "del", self.ns(i), check=False)  # its eth0 goes with it, and the peer
        _ip("link", "del", self.bridge, check=False)


@dataclass
class RayHosts:
    """Commands as a user types them, on this machine (``bed`` None) or on each host of a
    bed, each host keeping its Ray files apart (RAY_TMPDIR: separate machines have separate
    /tmp): ``ray start``, then ``dsec cluster up`` on the head as the README has it.
    :meth:`down` ends every process these hosts' Ray started (each carries its RAY_TMPDIR),
    then the bed."""

    bed: NetBed | None = None
    tmp: dict[int, str] = field(default_factory=dict)
    auth: str = ""  # Ray's token file, shared by the hosts (one machine's filesystem)

    @property
    def ids(self) -> list[int]:
        return self.bed.hosts if self.bed else [1]

    def env(self, i: int) -> dict[str, str]:
        if i not in self.tmp:
            self.tmp[i] = tempfile.mkdtemp(prefix=f"rt{i}-", dir="/tmp")  # short: Ray's sockets live there
        # Ray's token auth on every host (docs/cluster.md): the same token file, 0600, by path
        if not self.auth:
            self.auth = rayauth.token_file(os.path.join(tempfile.mkdtemp(prefix="rayauth-"), "token"))
        return {**os.environ, "RAY_TMPDIR": self.tmp[i], **rayauth.env(self.auth)}

    def run(self, i: int, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``argv`` on host ``i``; its program (``ray``, ``dsec``, ``python``) from this
        Python's environment."""
        cmd = [os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]]
        if self.bed:
            cmd = self.bed.argv(i, cmd)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(i))

    def ok(self, i: int, *argv: str, timeout: float = 600) -> str:
        out = self.run(i, *argv, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"on host {i}: {' '.join(argv[:3])} exited {out.returncode}:\n"
                               f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return out.stdout

    def start_ray(self, resources: str = '{"dsec_edge": 1}') -> str:
        """A Ray head on the first host, every other host joined to it; the head's address."""
        head, *others = self.ids
        self.ok(head, "ray", "start", "--head", "--resources", resources, "--include-dashboard=false", *RAY_BOUNDS)
        ip = self.bed.addr(head) if self.bed else self.ok(
            head, "python", "-c", "import ray; ray.init(address='auto', logging_level='error'); "
                                  "print(ray.util.get_node_ip_address())").strip().splitlines()[-1]
        for i in others:
            self.ok(i, "ray", "start", f"--address={ip}:6379", "--resources", resources, *RAY_BOUNDS)
        return ip

    def cluster_up(self, store: str, data_root: str, apiservers: int = 2) -> tuple[list[str], str]:
        """``dsec cluster up --ray-address auto`` on the head: (the replicas' URLs, the admin token)."""
        out = self.ok(self.ids[0], "dsec", "cluster", "up", "--ray-address", "auto", "--store", store,
                      "--apiservers", str(apiservers), "--data-root", data_root)
        urls = re.search(r"apiservers: (\S+)", out)
        if not urls:
            raise RuntimeError(f"dsec cluster up printed no apiservers:\n{out[-2000:]}")
        with open(os.path.join(data_root, "token")) as f:
            return urls.group(1).split(","), f.read().strip()

    def down(self) -> None:
        marks = {f"RAY_TMPDIR={t}" for t in self.tmp.values()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_with_env(marks):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while _pids_with_env(marks) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.bed:
            self.bed.down()
        for t in self.tmp.values():
            shutil.rmtree(t, ignore_errors=True)
        if self.auth:
            shutil.rmtree(os.path.dirname(self.auth), ignore_errors=True)


def _pids_with_env(marks: set[str]) -> list[int]:
    """Processes (not this one) whose environment holds one of ``marks`` (NAME=VALUE)."""
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

