"""The cluster demo: dsec on a 3-node Ray cluster on this machine (three raylets, a
private PostgreSQL, a MooseFS store: dsec.control.cluster.local), the README demo (demo/run.py)
run through both apiserver replicas, where each sandbox ran, the cluster's status, and
everything torn down again. Exits non-zero if any sandbox failed.

``--hosts``: the nodes are hosts of a namespace bed instead (dsec.control.cluster.netbed: each its
own network namespace and address on a bridge), brought up with the README's commands
(`ray start`, `dsec cluster up --ray-address auto` without --db), so the database, edges
and replicas are reached across real addresses, as across machines."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from rich.console import Console

from dsec.control.cluster import ops
from dsec.control.cluster.local import LocalCluster
from dsec.control.cluster.netbed import NetBed, RayHosts
from dsec.node.layers.store import LayerStore
from dsec.node.storage.moosefs import MooseFS


def seed_guest(data_dir: str, source: str) -> None:
    """Each edge gets the VM guest (kernel, initramfs) setup prepared, hard-linked."""
    guest = os.path.join(source, "vm", "guest")
    if os.path.isdir(guest):
        os.makedirs(os.path.join(data_dir, "vm"), exist_ok=True)
        subprocess.run(["cp", "-al", guest, os.path.join(data_dir, "vm", "guest")], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=16, help="sandboxes to run concurrently")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--hosts", action="store_true", help="each node a host of a namespace bed")
    a = ap.parse_args()
    console = Console()
    source = os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec")
    if a.hosts:
        return on_hosts(a.nodes, a.n, source, console)
    root = tempfile.mkdtemp(prefix="dsec-cluster-demo-")
    names = tuple(f"node{i + 1}" for i in range(a.nodes))
    local = LocalCluster(root, names, os.path.join(source, "layers"), {"base/debian:12"},
                         seed=lambda d: seed_guest(d, source))
    try:
        console.print(f"== starting a {a.nodes}-node Ray cluster with PostgreSQL and MooseFS, then dsec cluster up")
        up = local.start()
        console.print(f"edges: {', '.join(up.edges)}; apiservers: {', '.join(up.apiservers)}")
        env = {**os.environ, "DSEC_URL": ",".join(up.apiservers), "DSEC_TOKEN": up.token}
        rc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "run.py"), "-n", str(a.n)],
                            env=env).returncode
        st = ops.status(local.address)
        for e in st["edges"]:
            console.print(f"edge {e['name']}: {e['state']}, {'healthy' if e['healthy'] else 'unhealthy'}, "
                          f"{(e['stats'] or {}).get('sandboxes', '-')} sandboxes now")
        return rc
    finally:
        console.print("== tearing the cluster down")
        failed = local.stop()
        shutil.rmtree(root, ignore_errors=True)
        for e in failed:
            console.print(f"[red]teardown: {e}[/red]")


def on_hosts(nodes: int, n: int, source: str, console: Console) -> int:
    root = tempfile.mkdtemp(prefix="dsec-cluster-demo-")
    os.chmod(root, 0o711)  # the private PostgreSQL runs as its own user under it
    fs = MooseFS(os.path.join(root, "moosefs"))
    hosts = RayHosts(NetBed(f"d{os.getpid() % 10000}", nodes).up())
    try:
        fs.start()
        store = os.path.join(fs.mount, "dsec")
        os.makedirs(store, exist_ok=True)
        LayerStore(store, "sharedfs").link_from(os.path.join(source, "layers"), {"base/debian:12"})
        console.print(f"== {nodes} hosts on a bridge; ray start on each; dsec cluster up on the first")
        head = hosts.start_ray()
        urls, token = hosts.cluster_up(store, os.path.join(root, "cluster"))
        console.print(f"Ray head at {head}; apiservers: {', '.join(urls)}")
        env = {**os.environ, "DSEC_URL": ",".join(urls), "DSEC_TOKEN": token}
        rc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "run.py"), "-n", str(n)],
                            env=env).returncode
        console.print(hosts.ok(hosts.ids[0], "dsec", "cluster", "status", "--ray-address", "auto"))
        return rc
    finally:
        console.print("== tearing the cluster down")
        if hosts.tmp:
            hosts.run(hosts.ids[0], "dsec", "cluster", "down", "--ray-address", "auto", "--stop-sandboxes")
        hosts.down()
        fs.stop()
        with open("/proc/self/mountinfo") as f:
            left = [ln.split()[4] for ln in f if root in ln]
        for m in sorted(left, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
