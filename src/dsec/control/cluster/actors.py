"""The Ray actors of a cluster and who owns what:

- ``Controller`` (one, detached, named ``controller`` in the ``dsec`` namespace, restarted
  by Ray): starts an ``EdgeActor`` on every node that has the ``dsec_edge`` resource (nodes
  that join later too) and the ``ApiserverActor`` replicas; runs the watcher that polls
  every edge and writes the fleet view to the registry; marks an edge lost when Ray says
  its node is dead, and cleans up what a returning node still holds. It keeps nothing it
  cannot rebuild from Ray and the registry. It also publishes the cluster's own addresses
  (``cluster_addresses``: dsec.node.edge.network.wall), which every edge walls its sandboxes off from.
- ``EdgeActor`` (one per node, pinned to it, restarted by Ray): owns the node's ``dsec
  edge serve`` process (dsec.control.cluster.daemon says why an owned process and not the actor
  itself: the edge is a root daemon with its own event loop, signal handling and host
  state, and a Ray worker is none of those) and registers it. A start that fails is tried
  again with backoff and said in the registry (``starting:edge:NAME``) until it serves.
- ``ApiserverActor`` (N, spread over nodes, restarted by Ray): owns one ``dsec apiserver
  --db`` process. Requests go straight to that process; Ray is not on the request path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import pwd
import re
import signal
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dsec.control.cluster import certs, postgres
from dsec.control.cluster.config import EDGE_NAME_LABEL, NAMESPACE, ClusterConfig
from dsec.control.cluster.daemon import Daemon, dsec_argv, free_port, http_ok, start_retrying
from dsec.control.cluster.view import ClusterEdges
from dsec.control.health.events import FleetEvents
from dsec.control.mover import Mover
from dsec.control.placement.engine import Placement
from dsec.node.checkpoints.store import CheckpointStore
from dsec.node.edge.network import wall
from dsec.shared import tls
from dsec.shared.errors import DsecError
from dsec.shared.meta import open_db
from dsec.shared.meta.registry import Registry

log = logging.getLogger("dsec.cluster")
CONTROLLER = "controller"
RECONCILE_S = 1.0
CLEAN_TIMEOUT_S = 30.0  # stopping what a returned edge still holds: bounded like any call
DOWN_WAIT_S = 60.0  # `down --stop-sandboxes` waits this long for edges still starting
STALE_SWEEP_S = 60.0  # copies of sandboxes that run elsewhere now are looked for this often per edge
STARTING = "starting:"  # a registry setting per daemon whose starts fail: its last error
# an edge registered on a node this Ray cluster never knew (Ray itself restarted: the whole
# cluster stopped uncleanly and came back) has this long to register again before it is lost
RETURN_GRACE_S = 180.0


def _secret_file(directory: str, secret: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "cluster.key")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(path + ".tmp", path)
    return path


def _addresses(cfg: ClusterConfig) -> tuple[str, str]:
    """(what a daemon binds, what others reach it at): the listen host given, else the
    node's IP (Ray's: the address the other nodes know it by); bound to every address, it
    is reached at the node's IP."""
    node_ip = ray.util.get_node_ip_address()
    bind = cfg.listen_host or node_ip
    return bind, node_ip if bind in postgres.ANY_HOST else bind


class _DaemonTLS:
    """A daemon's side of the cluster's mutual TLS: its certificate (made here, on its own
    node, signed by the cluster CA from the registry) in DIRECTORY/tls, the options that
    hand it the files, and the renewals of ``dsec cluster rotate-certs``."""

    def __init__(self, cfg: ClusterConfig, registry: Registry, directory: str, name: str, hosts: list[str]) -> None:
        self.registry, self.name = registry, name
        self.hosts = [h for h in dict.fromkeys(hosts) if h and h not in postgres.ANY_HOST]
        self.dir = os.path.join(directory, "tls")
        self.files = certs.daemon_files(registry, self.dir, name, self.hosts) if cfg.tls else None

    @property
    def scheme(self) -> str:
        return "https" if self.files else "http"

    def argv(self) -> list[str]:
        f = self.files
        return ["--tls-cert", f.cert, "--tls-key", f.key, "--ca", f.ca] if f else []

    def client(self) -> ssl.SSLContext | None:
        return tls.client_context(self.files) if self.files else None

    def trust(self) -> None:
        if self.files:
            certs.trust_now(self.registry, self.dir)

    def renew(self) -> None:
        if self.files:
            certs.daemon_files(self.registry, self.dir, self.name, self.hosts)


def _tracing_env(cfg: ClusterConfig) -> dict[str, str]:
    """The tracing variables `cluster up` was given (docs/tracing.md), under the node's own:
    the daemon's ``dsec.shared.tracing.setup`` reads them."""
    return {k: v for k, v in cfg.tracing_env.items() if k not in os.environ}


def _reporter(registry: Registry, what: str) -> Callable[[str | None, int], None]:
    """Where a daemon's failed starts are said for ``dsec cluster status`` and ``up``:
    the setting ``starting:WHAT`` (its last error and tries), gone once it serves."""
    def report(error: str | None, tries: int) -> None:
        if error is None:
            registry.drop_setting(f"{STARTING}{what}")
        else:
            registry.put_setting(f"{STARTING}{what}", json.dumps({"error": error, "tries": tries, "at": time.time()}))
    return report


class EdgeActor:
    def __init__(self, cfg: dict[str, Any], name: str) -> None:
        self.cfg = ClusterConfig(**cfg)
        self.name = name
        self.node_id = ray.get_runtime_context().get_node_id()
        host, reached = _addresses(self.cfg)
        port = self.cfg.edge_port or free_port(host)
        data = os.path.join(self.cfg.data_root, name)
        secret_file = _secret_file(data, self.cfg.secret)
        registry = Registry(open_db(self.cfg.db, migrate=False))
        self.tls = _DaemonTLS(self.cfg, registry, data, name, [reached, host])
        self.url = f"{self.tls.scheme}://{reached}:{port}"
        argv = dsec_argv("edge", "serve", "--name", name, "--listen", f"{host}:{port}", "--secret-file", secret_file,
                         "--data-dir", data, "--log-level", self.cfg.log_level, *self.tls.argv(),
                         *(["--store", self.cfg.store] if self.cfg.store else []),
                         *self.cfg.edge_args, *self.cfg.edge_args_by_name.get(name, []))
        # the probe presents the edge's own certificate (the daemon requires one)
        probe = self.tls.client()
        # the layer catalog's database through the environment, not argv: its URL has a password
        self.daemon = start_retrying(
            lambda: Daemon(argv, os.path.join(data, "edge.log"),
                           http_ok(f"{self.url}/healthz", {"Authorization": f"Bearer {self.cfg.secret}"}, probe),
                           env={**_tracing_env(self.cfg), "DSEC_DB": self.cfg.db}),
            _reporter(registry, f"edge:{name}"))
        registry.register(name, self.url, self.node_id)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "node_id": self.node_id, "pid": self.daemon.proc.pid}

    def trust(self) -> None:
        self.tls.trust()

    def renew(self) -> None:
        self.tls.renew()

    def shutdown(self) -> int | None:
        return self.daemon.stop()


class ApiserverActor:
    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        self.cfg = ClusterConfig(**cfg)
        self.index = index
        host, reached = _addresses(self.cfg)
        port = self.cfg.api_port + index if self.cfg.api_port else free_port(host)
        data = os.path.join(self.cfg.data_root, f"apiserver-{index}")
        secret_file = _secret_file(data, self.cfg.secret)
        self.url = f"http://{reached}:{port}"
        registry = Registry(open_db(self.cfg.db, migrate=False))
        # its certificate as the edges' client (the API it serves is plain HTTP as before)
        self.tls = _DaemonTLS(self.cfg, registry, data, f"apiserver-{index}", [reached])
        argv = dsec_argv("apiserver", "--secret-file", secret_file, "--host", host,
                         "--port", str(port), "--data-dir", data, "--log-level", self.cfg.log_level,
                         *self.tls.argv(), *(["--store", self.cfg.store] if self.cfg.store else []))
        # the token and the database's password through the environment, not argv (which
        # every user of the node can read)
        self.daemon = start_retrying(
            lambda: Daemon(argv, os.path.join(data, "apiserver.log"), http_ok(f"{self.url}/healthz", {}),
                           env={**_tracing_env(self.cfg), "DSEC_TOKEN": self.cfg.admin_token,
                                "DSEC_DB": self.cfg.db}),
            _reporter(registry, f"apiserver:{index}"))
        registry.put_setting(f"apiserver:{index}", self.url)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "pid": self.daemon.proc.pid}

    def trust(self) -> None:
        self.tls.trust()

    def renew(self) -> None:
        self.tls.renew()

    def shutdown(self) -> int | None:
        return self.daemon.stop()


class PostgresActor:
    """A private PostgreSQL on the node ``dsec cluster up`` ran on, for a cluster given no
    database: its server process owned like every other daemon."""

    def __init__(self, data_dir: str, host: str, port: int, allow: list[str]) -> None:
        password = postgres.init(data_dir)
        self.data_dir, self.host = data_dir, host
        postgres.admit(data_dir, postgres.networks(host, allow))
        # ready only once it takes queries, which after an unclean stop is after its crash
        # recovery: waited for (an actor that gave up would have the server killed mid-way)
        self.daemon = Daemon(postgres.argv(data_dir, host, port), data_dir.rstrip("/") + ".log",
                             lambda: postgres.ready(data_dir, port), user=pwd.getpwnam(postgres.USER).pw_uid,
                             stop_signal=signal.SIGINT,  # PostgreSQL's fast shutdown
                             start_timeout_s=postgres.START_TIMEOUT_S)
        postgres.create_database(data_dir, port)
        reached = ray.util.get_node_ip_address() if host in postgres.ANY_HOST else host
        self.url = postgres.url(reached, port, password)

    def db_url(self) -> str:
        return self.url

    def admit(self, allow: list[str]) -> list[str]:
        """The networks admitted now (a later `cluster up` may name others): pg_hba.conf
        rewritten and the server told to reload it."""
        nets = postgres.networks(self.host, allow)
        if postgres.admit(self.data_dir, nets) and self.daemon.proc.poll() is None:
            self.daemon.proc.send_signal(signal.SIGHUP)
        return nets

    def shutdown(self) -> int | None:
        return self.daemon.stop()


def cluster_entries(cfg: ClusterConfig, nodes: list[dict[str, Any]], edge_urls: list[str],
                    replica_urls: list[str], store_master: str | None) -> list[str]:
    """What sandboxes must never reach, as addresses, networks and names: every Ray node
    (alive or not: a node that comes back is infrastructure again at once), the edges' and
    replicas' hosts, the database's, the MooseFS master of the store, and ``--protect``."""
    found = {str(n.get("NodeManagerAddress") or "") for n in nodes}
    found |= {wall.url_host(u) or "" for u in [*edge_urls, *replica_urls, cfg.db]}
    found |= {store_master or "", *cfg.protect}
    out = set()
    for item in filter(None, found):
        try:
            out.add(wall.entry(item))
        except ValueError:
            log.warning("cluster address %r is not an address or a name: not walled off", item)
    return sorted(out)


def edge_name(node: dict[str, Any], taken: set[str], known: dict[str, str] | None = None) -> str:
    """The node's ``dsec-edge-name`` label, else its host name's first label, as an edge
    name (EDGE_NAME_RE: a sandbox id is EDGE-xxxxxxxxxxxx, so lower-case letters and digits
    only: "ip-10-0-0-7.ec2.internal" is "ip10007"). When another node has that name, its
    address is appended ("vm10213012"), not its Ray node id, which is new at every `ray
    start`: a node that comes back gets its edge's name, so its edge finds the data dir and
    the sandboxes it left (and stops those the cluster reported lost).

    ``known`` maps the registry's edges, lost ones included, to their hosts: a name stays
    with the address that first had it. Which of two nodes sharing a host name got the bare
    name depended on the order Ray listed them, so after a loss the survivor could take the
    lost node's name, and the lost node's sandboxes were looked for on the wrong node."""
    known = known or {}
    label = (node.get("Labels") or {}).get(EDGE_NAME_LABEL)
    addr = str(node.get("NodeManagerAddress") or "")
    if not label and addr:
        mine = sorted(n for n, host in known.items() if host == addr and n not in taken)
        if mine:
            return mine[0]
    raw = str(label or node.get("NodeManagerHostname") or "edge")
    name = re.sub(r"[^a-z0-9]", "", raw.lower().split(".")[0])
    if not name[:1].isalpha():
        name = "n" + name
    name = name[:31]
    held = taken | {n for n, host in known.items() if host != addr}
    if label or name not in held:
        return name
    for raw_tail in (addr, str(node["NodeID"])):  # nodes sharing an address: their Ray ids
        tail = re.sub(r"[^a-z0-9]", "", raw_tail.lower())
        if tail and (out := name[:max(1, 31 - len(tail))] + tail[-30:]) not in held:
            return out
    return out


class Controller:
    """Runs its reconcile loop in a thread of its own (an event loop there), so that Ray
    restarting the actor restarts the loop; its methods read what the loop found."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = ClusterConfig(**cfg)
        self.registry = Registry(open_db(self.cfg.db))
        # the controller polls the edges: a client certificate of its own, reloaded on rotation
        self.tls = _DaemonTLS(self.cfg, self.registry, os.path.join(self.cfg.data_root, "controller"), "controller",
                              [ray.util.get_node_ip_address()])
        self.client_tls = self.tls.client()
        if self.tls.files and self.client_tls:
            tls.Reloader(self.tls.files, [self.client_tls]).start()
        self.edges: dict[str, tuple[str, Any]] = {}  # node id -> (edge name, actor)
        self.apiservers: dict[int, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.last_error = ""
        self.round: dict[str, float] = {}  # when the last round ended, and what each step took
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._view: ClusterEdges | None = None
        self._mover: Mover | None = None
        self._restoring: dict[str, asyncio.Task[Any]] = {}  # sandbox -> its restore, under way
        self._registered: dict[str, tuple[str, float]] = {}  # edge -> (registration, when) stale copies swept
        self._published: str | None = None  # the cluster's addresses as last written
        self._store_master: tuple[float, str | None] = (0.0, None)  # (when read, the MooseFS master's host)
        self._thread = threading.Thread(target=self._run, name="controller", daemon=True)
        self._thread.start()

    # ---- what callers ask ----------------------------------------------------------
    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        view = self._view.view if self._view else {}
        edges = []
        for r in self.registry.edges():
            st = view.get(r.name) or r.stats
            edges.append({**r.model_dump(exclude={"stats"}), "healthy": r.name in view and view[r.name].healthy,
                          "stats": st.model_dump() if st else None})
        starting = {k.removeprefix(STARTING): json.loads(v) for k, v in self.registry.settings_like(STARTING).items()}
        return {"edges": edges,
                "apiservers": self.registry.settings_like("apiserver:"), "events": self.events[-50:],
                "last_error": self.last_error, "round": self.round, "failing_starts": starting}

    def shutdown(self, stop_sandboxes: bool = False) -> dict[str, Any]:
        """Stop the loop, then the replicas, then the edges (their sandboxes stopped first
        when asked; else they run on and a later ``up`` re-adopts them)."""
        self._stop.set()
        self._thread.join(10)
        stopped = 0
        if stop_sandboxes:  # a loop of its own, in a thread of its own (Ray may run this method on one)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                stopped = pool.submit(asyncio.run, self._stop_sandboxes()).result()
        for actor in self.apiservers.values():
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor, no_restart=True)
        for _, actor in self.edges.values():
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor, no_restart=True)
        self.registry.drop_settings("apiserver:")
        return {"sandboxes_stopped": stopped, "edges": len(self.edges), "apiservers": len(self.apiservers)}

    def rotate_certs(self, new_ca: bool = False) -> dict[str, Any]:
        """``dsec cluster rotate-certs``: a new CA if asked, then in two phases over every
        daemon (replicas, edges, this controller): all trust the new bundle (the new CA and
        the old), then all get new certificates. Each daemon reloads its files in place
        (dsec.shared.tls.Reloader): no connection, request or sandbox is dropped."""
        if not self.cfg.tls:
            raise ValueError("this cluster runs without TLS (cluster up --no-tls)")
        if new_ca:
            certs.new_ca(self.registry)
        actors = [a for _, a in self.edges.values()] + list(self.apiservers.values())
        for phase in ("trust", "renew"):
            ray.get([getattr(a, phase).remote() for a in actors], timeout=120)
            getattr(self.tls, phase)()
            # every daemon polls its files each RELOAD_POLL_S: all hold the phase before the next
            time.sleep(2.5 * tls.RELOAD_POLL_S)
        return {"daemons": len(actors) + 1, "new_ca": new_ca}

    async def _stop_sandboxes(self) -> int:
        view = ClusterEdges(self.registry, self.cfg.secret, tls=self.client_tls)
        n = 0
        try:
            # an edge still starting (Ray restarting it, a node just back) is waited for, bounded:
            # its sandboxes are stopped too rather than left to outlive the cluster
            owned = {name for name, _ in self.edges.values()}
            deadline = time.monotonic() + DOWN_WAIT_S
            while True:
                await view.refresh()
                serving = {name for name, st in view.view.items() if st.healthy}
                if owned <= serving or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            for edge in view.active().values():
                with contextlib.suppress(DsecError, OSError, TimeoutError):
                    infos = await asyncio.wait_for(edge.list_sandboxes(), 30)
                    live = [i for i in infos if i.state in ("running", "paused", "creating")]
                    await asyncio.gather(*(edge.stop(i.sandbox_id) for i in live), return_exceptions=True)
                    n += len(live)
                    self.registry.index_drop([i.sandbox_id for i in infos])
        finally:
            await view.close()
        return n

    # ---- the loop ------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"at": time.time(), "kind": kind, **fields})
        del self.events[:-200]
        log.info("%s %s", kind, fields)

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        self._view = ClusterEdges(self.registry, self.cfg.secret, poll=True, tls=self.client_tls)
        view = self._view
        self._mover = Mover(lambda: view, Placement(lambda: view.view), self.registry,
                            CheckpointStore(self.registry.db, None), FleetEvents(self.registry.db))
        try:
            while not self._stop.is_set():
                try:
                    t0 = time.monotonic()
                    await asyncio.to_thread(self._reconcile)
                    t1 = time.monotonic()
                    await self._view.refresh()
                    t2 = time.monotonic()
                    await asyncio.wait_for(self._clean_returned(), CLEAN_TIMEOUT_S)
                    await asyncio.wait_for(self._evict_stale(), CLEAN_TIMEOUT_S)
                    await self._restore_lost()
                    self.round = {"at": time.time(), "ray_s": t1 - t0, "watch_s": t2 - t1,
                                  "clean_s": time.monotonic() - t2, "restoring": len(self._restoring)}
                    self.last_error = ""
                except Exception as e:  # keep going: the next round may find the database or Ray back
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.exception("reconcile failed")
                await asyncio.sleep(RECONCILE_S)
        finally:
            await self._view.close()

    def _publish_addresses(self, nodes: list[dict[str, Any]], edge_urls: list[str]) -> None:
        if self.cfg.store and time.monotonic() - self._store_master[0] > STALE_SWEEP_S:
            # (mountinfo grows with every sandbox's mounts: read once a minute, not every round)
            self._store_master = (time.monotonic(), wall.moosefs_master(self.cfg.store))
        replicas = list(self.registry.settings_like("apiserver:").values())
        value = json.dumps(cluster_entries(self.cfg, nodes, edge_urls, replicas, self._store_master[1]))
        if value != self._published:  # written when it changes, not every round
            self.registry.put_setting(wall.SETTING, value)
            self._published = value
            self._event("cluster_addresses", entries=json.loads(value))

    def _reconcile(self) -> None:
        nodes = ray.nodes()
        alive = {n["NodeID"]: n for n in nodes if n["Alive"] and n["Resources"].get(self.cfg.resource, 0) >= 1}
        dead = {n["NodeID"] for n in nodes if not n["Alive"]}
        known = {n["NodeID"] for n in nodes}
        rows = {r.name: r for r in self.registry.edges()}
        try:
            self._publish_addresses(nodes, [r.url for r in rows.values()])
        except Exception as e:  # the edges keep the last list; starting edges must not wait on this
            log.warning("cluster addresses not published: %s", e)
        # nodes gone: their edges are lost, their sandboxes failed
        for node_id in [n for n in self.edges if n not in alive]:
            name, actor = self.edges.pop(node_id)
            ray.kill(actor, no_restart=True)
            self._event("edge_actor_removed", edge=name, node=node_id[:12])
        # a node this Ray cluster saw die is lost at once; one it never knew is from before a
        # restart of Ray itself (the whole cluster stopped and came back): its edge re-adopts
        # the sandboxes that still run when it registers again, and only if it does not come
        # back is it lost (marking it lost at once had the returning edge stop them all)
        waited = time.monotonic() - self.started_at > RETURN_GRACE_S
        for r in rows.values():
            if r.state == "active" and (r.node_id in dead or (r.node_id not in known and waited)):
                reason = (f"node lost: Ray node {r.node_id[:12]} is gone" if r.node_id in dead else
                          f"node lost: not back {RETURN_GRACE_S:g} s after the cluster came up again")
                self.registry.mark(r.name, "lost", reason)
                n = self.registry.mark_lost(r.name, "node lost")
                self._event("edge_lost", edge=r.name, node=r.node_id[:12], sandboxes=n)
        # nodes new (or back): an edge each
        taken = {name for name, _ in self.edges.values()}
        hosts = {r.name: urlsplit(r.url).hostname or "" for r in rows.values()}
        for node_id, node in alive.items():
            if node_id in self.edges:
                continue
            name = edge_name(node, taken, hosts)
            taken.add(name)
            actor = ray.remote(EdgeActor).options(  # type: ignore[attr-defined]
                name=f"edge:{name}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=0, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                    self.cfg.model_dump(), name)
            self.edges[node_id] = (name, actor)
            self._event("edge_actor_started", edge=name, node=node_id[:12])
        for i in range(self.cfg.apiservers):
            if i not in self.apiservers:
                where = ({"resources": {self.cfg.apiserver_resource: 0.001}} if self.cfg.apiserver_resource
                         else {"scheduling_strategy": "SPREAD"})
                self.apiservers[i] = ray.remote(ApiserverActor).options(  # type: ignore[attr-defined]
                    name=f"apiserver:{i}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                    max_restarts=-1, max_task_retries=0, num_cpus=0, **where).remote(self.cfg.model_dump(), i)

    async def _restore_lost(self) -> None:
        """Start restoring every checkpointed sandbox of a lost edge (in tasks of their own,
        MOVES_AT_ONCE at a time, each bounded); one whose restore failed stays failed, with
        the reason, until an operator retries it (POST /v1/sandboxes/{id}/restore)."""
        assert self._mover is not None
        for r in await asyncio.to_thread(self.registry.edges):
            if r.state != "lost":
                continue
            ids = [sid for sid in await asyncio.to_thread(self.registry.restorable_ids, r.name)
                   if sid not in self._restoring]
            for sid in await asyncio.to_thread(self._mover.checkpoints.sandboxes, ids):
                self._restoring[sid] = asyncio.create_task(self._restore_one(sid, r.name))

    async def _restore_one(self, sandbox_id: str, edge: str) -> None:
        assert self._mover is not None
        try:
            info = await self._mover.restore_lost(sandbox_id, edge)
            self._event("sandbox_restored", sandbox=sandbox_id, lost_edge=edge, edge=info.edge)
        except Exception as e:  # recorded (index and fleet event) by the mover
            self._event("sandbox_restore_failed", sandbox=sandbox_id, lost_edge=edge, error=str(e))
        finally:
            self._restoring.pop(sandbox_id, None)

    async def _evict_stale(self) -> None:
        """An edge that (re)registered may hold sandboxes that run elsewhere now (restored
        while its node was away, or restored twice by a controller that restarted mid-way):
        evict those there, keeping their checkpoints. Once per registration."""
        assert self._view is not None
        for name, edge in self._view.active().items():
            row = self._view.rows.get(name)
            # at each registration (a node back, a daemon on a new port), and every STALE_SWEEP_S
            key = f"{row.node_id} {row.url}" if row else ""
            seen = self._registered.get(name)
            if row is None or (seen and seen[0] == key and time.monotonic() - seen[1] < STALE_SWEEP_S):
                continue
            try:
                infos = await asyncio.wait_for(edge.list_sandboxes(), CLEAN_TIMEOUT_S)
            except (DsecError, OSError, TimeoutError) as e:  # next round
                log.warning("edge %s not listed for stale copies: %s", name, e)
                continue
            live = [i.sandbox_id for i in infos if i.state in ("running", "paused", "creating")]
            index = await asyncio.to_thread(self.registry.index_rows, live)
            stale = {sid: holder for sid, (holder, restore) in index.items()
                     if holder != name and restore is None and sid not in self._restoring}
            failed = 0
            for sid, holder in stale.items():
                try:
                    await asyncio.wait_for(edge.evict(sid, holder), CLEAN_TIMEOUT_S)
                    self._event("stale_copy_evicted", edge=name, sandbox=sid, holder=holder)
                except (DsecError, OSError, TimeoutError) as e:
                    failed += 1
                    log.warning("stale copy of %s on %s not evicted: %s", sid, name, e)
            if not failed:  # else the next round tries again
                self._registered[name] = (key, time.monotonic())

    async def _clean_returned(self) -> None:
        """An edge back after its node was lost may still hold sandboxes the cluster has
        reported failed: stop them there, and forget them."""
        assert self._view is not None
        for name, edge in self._view.active().items():
            ids = await asyncio.to_thread(self.registry.lost_ids, name)
            if not ids:
                continue
            results = await asyncio.gather(*(edge.stop(sid) for sid in ids), return_exceptions=True)
            gone = [sid for sid, r in zip(ids, results, strict=True)
                    if not isinstance(r, BaseException) or getattr(r, "status", 0) == 404]
            await asyncio.to_thread(self.registry.index_drop, gone)
            self._event("returned_edge_cleaned", edge=name, sandboxes=len(gone))


def controller(cfg: ClusterConfig) -> Any:
    """The cluster's controller: started if it is not running, else the running one."""
    return ray.remote(Controller).options(  # type: ignore[attr-defined]
        name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
        max_task_retries=0, num_cpus=0).remote(cfg.model_dump())
