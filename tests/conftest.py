"""Test fixtures: a real ``dsec serve`` (crun, overlayfs, EROFS, cgroups) on a free
loopback port, with its own data dir whose layer store is hard-linked from the one
``scripts/setup.sh`` built. Nothing is mocked."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import dsec
from dsec.node.edge.leftovers import qemu_pids, sandbox_leftovers  # noqa: F401 (tests import qemu_pids from here)
from dsec.node.layers.store import LayerStore

SRC_DATA = os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec")
TOKEN = "test-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _seed_layers(data_dir: str) -> None:
    src = os.path.join(SRC_DATA, "layers")
    if not os.path.exists(os.path.join(src, "catalog.db")):
        pytest.fail(f"no base layers in {src}: run scripts/setup.sh first")
    assert LayerStore(os.path.join(data_dir, "layers")).link_from(src) >= 2
    _seed_vm(data_dir)


def _seed_vm(data_dir: str) -> None:
    # the VM guest (kernel, initramfs, accelerator verdict) that setup prepared
    guest = os.path.join(SRC_DATA, "vm")
    if os.path.isdir(os.path.join(guest, "guest")):
        os.makedirs(os.path.join(data_dir, "vm"), exist_ok=True)
        subprocess.run(["cp", "-al", os.path.join(guest, "guest"), os.path.join(data_dir, "vm", "guest")], check=True)
        if os.path.exists(os.path.join(guest, "accel.json")):
            subprocess.run(["cp", os.path.join(guest, "accel.json"), os.path.join(data_dir, "vm")], check=True)


class Service:
    """One dsec process under test (``dsec serve``, ``dsec edge serve``, ``dsec apiserver``),
    ready when its /healthz answers."""

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str] | None = None,
                 health_headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.argv = argv
        self.env = env or {}  # added to this process's environment (the fault tests' failpoints)
        self.port = _free_port()
        self.tls = tls  # an https daemon's probe: a client certificate and the CA (tests/test_tls.py)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.health_headers = health_headers or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(log_path, "ab")  # noqa: SIM115

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dsec.client.cli.main", *self.argv,
                "--log-level", os.environ.get("DSEC_TEST_LOG_LEVEL", "warning")]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=self.log, start_new_session=True,
                                     env={**os.environ, **self.env})
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, headers=self.health_headers,
                             verify=self.tls or True).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.argv[0]} did not become ready; see {self.log.name}")

    def stop(self, crash: bool = False) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, crash: bool = False) -> None:
        self.stop(crash=crash)
        self.start()


class Platform(Service):
    """One embedded dsec process under test (``dsec serve``)."""

    def __init__(self, data_dir: str, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.extra_args = extra_args or []
        super().__init__([], os.path.join(data_dir, "serve.log"), env)
        self.edge_dirs = [data_dir]

    def command(self) -> list[str]:
        self.argv = ["serve", "--port", str(self.port), "--data-dir", self.data_dir, "--token", TOKEN,
                     *self.extra_args]
        return super().command()


SECRET = "cluster-secret-0123456789abcdef"


class Cluster:
    """Edge daemons (``dsec edge serve``) and an apiserver (``dsec apiserver``) in front of
    them, on this machine, each edge with its own data dir. One edge may share its data
    dir (and so its layer store) with the apiserver; several share ``store``, a MooseFS
    mount (as nodes do). Offers what tests use of a :class:`Platform`."""

    def __init__(self, root: str, names: tuple[str, ...] = ("n1",), store: str | None = None,
                 edge_args: dict[str, list[str]] | None = None, tls: bool = False) -> None:
        """``tls``: mutual TLS on the edge wire, a CA and a certificate per daemon in ROOT/tls."""
        assert store is not None or len(names) == 1, "edges of one cluster share a store"
        self.root, self.store = root, store
        self.tls_dir = os.path.join(root, "tls")
        self.probe: ssl.SSLContext | None = None
        if tls:
            from dsec.shared import tls as wire_tls

            self.ca_cert, self.ca_key = wire_tls.make_ca()
            self.probe = wire_tls.client_context(self.tls_files("probe"))
        self.secret_file = os.path.join(root, "cluster.key")
        with open(self.secret_file, "w") as f:
            f.write(SECRET + "\n")
        self.edges: dict[str, Service] = {}
        for name in names:
            d = os.path.join(root, name)
            os.makedirs(d, exist_ok=True)
            (_seed_vm if store else _seed_layers)(d)
            e = Service([], os.path.join(d, "edge.log"), health_headers={"Authorization": f"Bearer {SECRET}"},
                        tls=self.probe)
            e.argv = ["edge", "serve", "--name", name, "--listen", f"127.0.0.1:{e.port}", "--secret-file",
                      self.secret_file, "--data-dir", d, *(["--store", store] if store else []),
                      *(self.tls_args(name) if tls else []), *(edge_args or {}).get(name, [])]
            self.edges[name] = e
        if store:
            LayerStore(store, "sharedfs").link_from(os.path.join(SRC_DATA, "layers"), SHARED_LAYERS)
        self.data_dir = os.path.join(root, "apiserver") if store else os.path.join(root, names[0])
        os.makedirs(self.data_dir, exist_ok=True)
        edges = ",".join(f"{n}={e.url}" for n, e in self.edges.items())
        self.api = Service(["apiserver", "--edges", edges, "--secret-file", self.secret_file, "--data-dir",
                            self.data_dir, *(["--store", store] if store else []), "--token", TOKEN,
                            *(self.tls_args("apiserver") if tls else [])],
                           os.path.join(self.data_dir, "apiserver.log"))
        self.api.argv += ["--port", str(self.api.port)]
        self.url = self.api.url

    def tls_files(self, name: str) -> Any:
        """A certificate for ``name`` (and 127.0.0.1) by this cluster's CA, in ROOT/tls/NAME."""
        from dsec.shared import tls as wire_tls

        return wire_tls.write_daemon_files(os.path.join(self.tls_dir, name), self.ca_cert, self.ca_cert, self.ca_key,
                                           name, ["127.0.0.1"])

    def tls_args(self, name: str) -> list[str]:
        f = self.tls_files(name)
        return ["--tls-cert", f.cert, "--tls-key", f.key, "--ca", f.ca]

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.api.proc

    @property
    def edge_dirs(self) -> list[str]:
        return [os.path.join(self.root, name) for name in self.edges]

    def start(self) -> None:
        for e in self.edges.values():
            e.start()
        self.api.start()

    def stop(self, crash: bool = False) -> None:
        self.api.stop(crash)
        for e in self.edges.values():
            e.stop(crash)


SHARED_LAYERS = {"base/busybox:latest", "base/debian:12"}  # what a cluster on MooseFS gets (all: too slow)


def own_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, names: tuple[str, ...] = ("n1",),
                store: str | None = None, edge_args: dict[str, list[str]] | None = None,
                tls: bool = False) -> Iterator[Cluster]:
    """A cluster on fresh dirs, for a fixture to yield from; its sandboxes are stopped
    when the fixture ends."""
    c = Cluster(str(tmp_path_factory.mktemp(name)), names, store, edge_args, tls)
    try:
        c.start()
        yield c
    finally:
        stop_all(c)


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "dsec-data")


def own_platform(tmp_path_factory: pytest.TempPathFactory, name: str, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Iterator[Platform]:
    """A platform on a fresh data dir, for a fixture to yield from; its sandboxes are
    stopped when the fixture ends."""
    data_dir = str(tmp_path_factory.mktemp(name))
    _seed_layers(data_dir)
    p = Platform(data_dir, extra_args, env)
    p.start()
    yield p
    stop_all(p)


def stop_all(p: Platform | Cluster) -> None:
    """Release whatever a failing test left, through the API, then stop the edge
    (sandboxes outlive an edge's stop, so a fixture that only stops it leaks them)."""
    try:
        if p.proc is not None:
            with dsec.Client(url=p.url, token=TOKEN) as c:
                for info in c.list():
                    c.connect(info.sandbox_id).stop()
    finally:
        p.stop()


@pytest.fixture
def e2b_env(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The E2B SDKs pointed at the session's platform (their environment variables)."""
    monkeypatch.setenv("E2B_API_URL", platform.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", platform.url)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    yield


@pytest.fixture
async def client(platform: Platform) -> dsec.AsyncClient:  # type: ignore[misc]
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        yield c


@pytest.fixture
async def debian(client: dsec.AsyncClient) -> dsec.AsyncSandbox:  # type: ignore[misc]
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=256,
                                                       cpu_cores_limit=0.5))
    yield sb
    await sb.stop()


@pytest.fixture
async def busybox(client: dsec.AsyncClient) -> dsec.AsyncSandbox:  # type: ignore[misc]
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64,
                                                       cpu_cores_limit=0.25))
    yield sb
    await sb.stop()


def sandbox_dir(platform: Platform, sandbox_id: str) -> str:
    """Where the edge keeps a sandbox's files: on its btrfs volume, or (without one) in its data dir."""
    root = os.path.join(platform.data_dir, "edges", "edge0")
    vol = os.path.join(root, "volume", "sandboxes")
    return os.path.join(vol if os.path.isdir(vol) else os.path.join(root, "sandboxes"), sandbox_id)


def leftovers(platform: Platform, sandbox_id: str) -> list[str]:
    """Everything of ``sandbox_id`` still on this host (dsec.node.edge.leftovers). Empty means
    fully released."""
    return sandbox_leftovers(sandbox_id, platform.edge_dirs)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
