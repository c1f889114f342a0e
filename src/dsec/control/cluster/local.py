"""A whole dsec cluster on this one machine, for the cluster demo, the benchmarks and the
tests: several Ray raylets (ray.cluster_utils), each with the ``dsec_edge`` resource and a
``dsec-edge-name`` label, a MooseFS store and a private PostgreSQL, then ``dsec cluster up``
over them. Everything is real; only the machines are one. Each edge gets its own data
dir (and so run dir, cgroup parent, subnet, nftables table and volume)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.cluster_utils import Cluster

from dsec.control.cluster import ops, rayauth
from dsec.control.cluster.config import EDGE_NAME_LABEL, EDGE_RESOURCE
from dsec.control.cluster.daemon import free_port
from dsec.control.cluster.postgres import Postgres
from dsec.node.layers.store import LayerStore
from dsec.node.storage.moosefs import MooseFS

# Ray declares a node dead after this many missed health checks (its default: 5 x 3 s);
# what an operator who wants node loss seen in seconds sets on the head node too
REPLICA_RESOURCE = "dsec_apiserver"
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class LocalCluster:
    def __init__(self, root: str, names: tuple[str, ...], source_layers: str, layers: set[str],
                 apiservers: int = 2, seed: Callable[[str], None] | None = None) -> None:
        """``layers`` of the store at ``source_layers`` are copied onto the shared store;
        ``seed(data_dir)`` prepares each edge's data dir before its edge starts."""
        self.root, self.names, self.apiservers = root, names, apiservers
        self.source_layers, self.layers, self.seed = source_layers, layers, seed
        self.fs = MooseFS(os.path.join(root, "moosefs"))
        # PostgreSQL runs as its own user: its dir must be reachable through every parent
        self.pg_root = tempfile.mkdtemp(prefix="dsec-pg-")
        os.chmod(self.pg_root, 0o711)
        self.pg = Postgres(os.path.join(self.pg_root, "data"), port=free_port("127.0.0.1"))
        self.ray: Cluster | None = None
        self.nodes: dict[str, Any] = {}  # edge name -> ray node
        self.store = os.path.join(self.fs.mount, "dsec")
        self.up: ops.UpResult | None = None
        # Ray's token (dsec.control.cluster.rayauth): every raylet, worker and this driver use it
        self.ray_token = rayauth.token_file(os.path.join(root, "ray-auth-token"))
        self._env_before: dict[str, str | None] | None = None

    @staticmethod
    def node_args(name: str) -> dict[str, Any]:
        return {"num_cpus": 1, "resources": {EDGE_RESOURCE: 1}, "labels": {EDGE_NAME_LABEL: name},
                "object_store_memory": 80 << 20}

    def start(self) -> ops.UpResult:
        self.fs.start()
        os.makedirs(self.store, exist_ok=True)
        LayerStore(self.store, "sharedfs").link_from(self.source_layers, self.layers)
        for name in self.names:
            self._seed(name)
        return self._ray_and_up(self.pg.start())

    def _ray_and_up(self, db: str) -> ops.UpResult:
        head = self.node_args(self.names[0])
        # the replicas live on the head node, which is never removed: a node taken away to
        # test node loss takes an edge, not the replicas the test talks through
        head["resources"] = {**head["resources"], REPLICA_RESOURCE: 1}
        if self._env_before is None:
            self._env_before = rayauth.enable_here(self.ray_token)
        self.ray = Cluster(initialize_head=True, head_node_args={
            **head, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS})
        self.nodes[self.names[0]] = self.ray.head_node
        for name in self.names[1:]:
            self.nodes[name] = self.ray.add_node(**self.node_args(name))
        self.up = ops.up(self.ray.address, db, store=self.store, apiservers=self.apiservers,
                         data_root=self.root, listen_host="127.0.0.1", edge_port=0, api_port=0,
                         apiserver_resource=REPLICA_RESOURCE)
        return self.up

    def crash(self) -> None:
        """Every process of the cluster SIGKILLed where it stands, as a power loss would: Ray's
        on every node (its GCS, raylets and workers), the edge and replica daemons its actors
        own, PostgreSQL. The sandboxes, the shared store's mount and the edges' lazy layer
        readers are not the cluster's processes: they run on, as they would on real nodes."""
        assert self.ray is not None
        nodes = [self.ray.head_node, *self.ray.worker_nodes]
        subprocess.run(["pkill", "-9", "-f", f"dsec.client.cli.main (edge serve|apiserver) .*--data-dir {self.root}/"],
                       check=False)
        for node in nodes:
            node.kill_all_processes(check_alive=False, allow_graceful=False)
        if self.pg.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pg.proc.pid, signal.SIGKILL)
            self.pg.proc.wait()
        ray.shutdown()  # this process's driver connection died with the GCS
        self.ray = None
        self.nodes.clear()

    def restart(self) -> ops.UpResult:
        """After :meth:`crash`: PostgreSQL on its data dir (crash recovery), a new Ray cluster
        with the same nodes, and `dsec cluster up` again, as an operator would."""
        return self._ray_and_up(self.pg.start())

    def _seed(self, name: str) -> None:
        if self.seed is not None:
            self.seed(os.path.join(self.root, name))

    @property
    def address(self) -> str:
        assert self.ray is not None
        return str(self.ray.address)

    def add_node(self, name: str) -> Any:
        assert self.ray is not None
        self._seed(name)
        self.nodes[name] = self.ray.add_node(**self.node_args(name))
        return self.nodes[name]

    def remove_node(self, name: str, graceful: bool = False) -> None:
        """The node dies (``graceful=False``: its raylet is killed, as a machine that goes)."""
        assert self.ray is not None
        self.ray.remove_node(self.nodes.pop(name), allow_graceful=graceful)

    def stop(self) -> list[Exception]:
        """Everything down, each step whatever the one before did; the errors met."""
        steps: list[Callable[[], object]] = []
        if self.ray is not None:
            address, ray_cluster = self.address, self.ray
            steps += [lambda: ops.down(address, stop_sandboxes=True), ray.shutdown, ray_cluster.shutdown]
        steps += [self.pg.remove, lambda: shutil.rmtree(self.pg_root, ignore_errors=True), self._sweep, self.fs.stop,
                  self._auth_off]
        failed = []
        for step in steps:
            try:
                step()
            except Exception as e:
                failed.append(e)
        return failed

    def _auth_off(self) -> None:
        if self._env_before is not None:
            rayauth.restore(self._env_before)
            self._env_before = None

    def _sweep(self) -> None:
        """What a dead edge leaves by design (its lazy layer reader outlives it, for the
        next start) goes with the cluster."""
        subprocess.run(["pkill", "-f", f"lazyfs --mount {self.root}"], check=False)
        time.sleep(0.5)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f if self.root in line and self.fs.mount not in line]
        for m in sorted(mounts, reverse=True):
            with contextlib.suppress(OSError):
                subprocess.run(["umount", "-l", m], check=False)
