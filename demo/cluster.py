"""The cluster demo: dsec on a 3-node Ray cluster on this machine (three raylets, a
private PostgreSQL, a MooseFS store: dsec.cluster.local), the README demo (demo/run.py)
run through both apiserver replicas, where each sandbox ran, the cluster's status, and
everything torn down again. Exits non-zero if any sandbox failed."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from rich.console import Console

from dsec.cluster import ops
from dsec.cluster.local import LocalCluster


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
    a = ap.parse_args()
    console = Console()
    source = os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec")
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


if __name__ == "__main__":
    sys.exit(main())
